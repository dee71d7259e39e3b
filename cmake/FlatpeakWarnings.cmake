# Warning and sanitizer flags shared by every target (flatpeak_set_warnings(target)).
set(FLATPEAK_WARNING_FLAGS -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wsign-conversion)

if(FLATPEAK_SANITIZE)
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
endif()

function(flatpeak_set_warnings target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${FLATPEAK_WARNING_FLAGS}>)
endfunction()

# Third-party dependencies, from Debian packages (tools/setup-deps.sh installs them).
#   nlohmann-json: card, config and plan JSON;  fmt: formatting;  CLI11: the command line;
#   Eigen: GEMMs in the CPU executor;  GoogleTest / Google Benchmark: tests and benchmarks;
#   OpenMPI (optional): multi-rank execution;  CUDA toolkit (optional): the CUDA backend.
# A package find_package does not find is taken from FLATPEAK_THIRD_PARTY_DIR, where
# tools/vendor-deps.sh copies them from Debian's packages, for a machine without those packages
# (the lent GPU machine, tools/gpu-check.sh): the same target names, the header-only libraries as
# imported interface targets (their headers SYSTEM, as find_package's), fmt header-only
# (FMT_HEADER_ONLY), GoogleTest built from its source. Where the packages are found nothing
# changes.
set(FLATPEAK_THIRD_PARTY_DIR "${PROJECT_SOURCE_DIR}/third_party" CACHE PATH
    "Copies of the dependencies (tools/vendor-deps.sh), used for a package find_package does not find")

function(flatpeak_vendored_headers package target subdir marker)
  set(include_dir "${FLATPEAK_THIRD_PARTY_DIR}/${subdir}")
  if(NOT EXISTS "${include_dir}/${marker}")
    message(FATAL_ERROR "flatpeak: ${package} not found, and no copy at ${include_dir}/${marker}: "
                        "install Debian's packages (bash tools/setup-deps.sh) or copy them there "
                        "on a machine that has them (bash tools/vendor-deps.sh)")
  endif()
  add_library(${target} INTERFACE IMPORTED)
  set_target_properties(${target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${include_dir}")
  message(STATUS "flatpeak: ${package} from ${include_dir}")
endfunction()

# A function, so that the options set for GoogleTest's own CMakeLists stay in its scope.
function(flatpeak_vendored_googletest)
  set(source_dir "${FLATPEAK_THIRD_PARTY_DIR}/googletest")
  if(NOT EXISTS "${source_dir}/CMakeLists.txt")
    message(FATAL_ERROR "flatpeak: GoogleTest not found, and no copy at ${source_dir}: install "
                        "Debian's packages (bash tools/setup-deps.sh), copy them there on a machine "
                        "that has them (bash tools/vendor-deps.sh), or configure with -DFLATPEAK_TESTS=OFF")
  endif()
  set(BUILD_GMOCK OFF)
  set(INSTALL_GTEST OFF)
  # Built only as far as a test links it; GoogleTest defines the GTest::gtest and GTest::gtest_main
  # aliases tests/CMakeLists.txt links.
  add_subdirectory("${source_dir}" "${PROJECT_BINARY_DIR}/third_party/googletest" EXCLUDE_FROM_ALL)
  # Its code, its warnings: -Werror builds of this project do not judge them.
  set_target_properties(gtest gtest_main PROPERTIES COMPILE_WARNING_AS_ERROR OFF)
  message(STATUS "flatpeak: GoogleTest from ${source_dir}")
endfunction()

find_package(nlohmann_json 3.10 QUIET)
if(NOT nlohmann_json_FOUND)
  flatpeak_vendored_headers(nlohmann-json nlohmann_json::nlohmann_json nlohmann_json nlohmann/json.hpp)
endif()
find_package(fmt QUIET)
if(NOT fmt_FOUND)
  flatpeak_vendored_headers(fmt fmt::fmt fmt fmt/format.h)
  set_target_properties(fmt::fmt PROPERTIES INTERFACE_COMPILE_DEFINITIONS FMT_HEADER_ONLY=1)
endif()
find_package(CLI11 QUIET)
if(NOT CLI11_FOUND)
  flatpeak_vendored_headers(CLI11 CLI11::CLI11 CLI11 CLI/CLI.hpp)
endif()
find_package(Eigen3 3.3 QUIET NO_MODULE)
if(NOT Eigen3_FOUND)
  flatpeak_vendored_headers(Eigen Eigen3::Eigen eigen3 Eigen/Core)
endif()
if(FLATPEAK_TESTS)
  find_package(GTest QUIET)
  if(NOT GTest_FOUND)
    flatpeak_vendored_googletest()
  endif()
endif()
if(FLATPEAK_BENCH)
  find_package(benchmark QUIET)
  if(NOT benchmark_FOUND)
    message(STATUS "flatpeak: Google Benchmark not found; benchmarks disabled")
    set(FLATPEAK_BENCH OFF)
  endif()
endif()

set(FLATPEAK_HAVE_MPI OFF)
if(FLATPEAK_MPI)
  find_package(MPI COMPONENTS CXX QUIET)
  if(MPI_CXX_FOUND)
    set(FLATPEAK_HAVE_MPI ON)
  endif()
endif()
message(STATUS "flatpeak: MPI ${FLATPEAK_HAVE_MPI}")

# CUDA is optional: look for nvcc on PATH and under /usr/local/cuda, which is where the
# toolkit lives on machines that do not put it on PATH.
set(FLATPEAK_HAVE_CUDA OFF)
if(FLATPEAK_CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    find_program(FLATPEAK_NVCC nvcc HINTS ENV CUDA_HOME ENV CUDA_PATH PATHS /usr/local/cuda/bin)
    if(FLATPEAK_NVCC)
      set(CMAKE_CUDA_COMPILER "${FLATPEAK_NVCC}" CACHE FILEPATH "CUDA compiler")
    endif()
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)  # H100/H200; the targets that matter
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    if(NOT TARGET CUDA::cublas)
      # A toolkit without cuBLAS: the one of the Python package nvidia-cublas, whose folder
      # (include/, lib/libcublas.so.13, no unversioned names) $CUBLAS_HOME names
      # (tools/gpu-check.sh sets it only where the toolkit has no cuBLAS).
      find_path(FLATPEAK_CUBLAS_INCLUDE_DIR cublas_v2.h HINTS ENV CUBLAS_HOME PATH_SUFFIXES include)
      find_library(FLATPEAK_CUBLAS_LIBRARY NAMES cublas libcublas.so.13 NAMES_PER_DIR
                   HINTS ENV CUBLAS_HOME PATH_SUFFIXES lib lib64)
      find_library(FLATPEAK_CUBLASLT_LIBRARY NAMES cublasLt libcublasLt.so.13 NAMES_PER_DIR
                   HINTS ENV CUBLAS_HOME PATH_SUFFIXES lib lib64)
      if(NOT FLATPEAK_CUBLAS_INCLUDE_DIR OR NOT FLATPEAK_CUBLAS_LIBRARY OR NOT FLATPEAK_CUBLASLT_LIBRARY)
        message(FATAL_ERROR "flatpeak: cuBLAS not found beside the toolkit (${CUDAToolkit_LIBRARY_DIR}) "
                            "nor under $CUBLAS_HOME; configure with -DFLATPEAK_CUDA=OFF to build without CUDA")
      endif()
      add_library(CUDA::cublas UNKNOWN IMPORTED)
      set_target_properties(CUDA::cublas PROPERTIES
        IMPORTED_LOCATION "${FLATPEAK_CUBLAS_LIBRARY}"
        INTERFACE_INCLUDE_DIRECTORIES "${FLATPEAK_CUBLAS_INCLUDE_DIR}"
        INTERFACE_LINK_LIBRARIES "${FLATPEAK_CUBLASLT_LIBRARY};CUDA::cudart")
      message(STATUS "flatpeak: cuBLAS ${FLATPEAK_CUBLAS_LIBRARY}")
    endif()
    set(FLATPEAK_HAVE_CUDA ON)
  endif()
endif()
message(STATUS "flatpeak: CUDA ${FLATPEAK_HAVE_CUDA}")

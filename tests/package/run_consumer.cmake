# Builds and runs the consumer project (consumer/) against epx, one way (cmake -P):
#   -DMODE=find_package|add_subdirectory|fetchcontent
#   -DEPX_SOURCE_DIR=<epx source>  -DEPX_BINARY_DIR=<a configured epx build, for install>
#   -DWORK_DIR=<scratch dir>  -DGENERATOR=<cmake generator>  -DCXX=<C++ compiler>
#   -DEXPECT=<file with the expected stdout>
#   -DVERSION=<version asked of find_package>  -DEXPECT_CONFIGURE_FAILURE=ON
#   -DEPX_PROJECT_VERSION=<x.y.z>  epx's project version: find_package must report it and
#                             the EPX_VERSION_* macros of the headers must spell it
#   -DEPX_HAVE_CUDA=ON|OFF  whether the installed package must provide epx::cuda
#   -DEPX_ENABLE_CUDA=ON|OFF  passed on to the consumer when given; without it, the
#                             add_subdirectory and fetchcontent modes check that epx, not
#                             being the top-level project, probed for neither CUDA nor MPI
#   -DEPX_HAVE_OPENMP=ON|OFF  whether epx::epx carries OpenMP: the consumer, linking only
#                             epx::epx, must then compile with it and run exec::openmp on
#                             2 threads (it prints "exec::openmp: parallel, 2 threads")
#                             and its plans' default_chunks(exec::openmp{}) is then the
#                             thread count (the program runs with OMP_NUM_THREADS=3), else 1
#   -DCUDA_OPENMP=ON|OFF      nvcc compiles openmp.cu into the consumer program beside
#                             main.cpp (default: EPX_HAVE_CUDA in the find_package mode, OFF
#                             otherwise): it must print the same as main.cpp (OpenMP reaches
#                             CUDA sources through epx::epx)
#   -DINSTALL_CONFIGURE_FLAGS="<flags>"  (find_package) install from a fresh configure of
#                             EPX_SOURCE_DIR with these flags (README's install command)
#                             instead of EPX_BINARY_DIR, where find_package finds no
#                             package configuration file (no doctest, no Google Benchmark);
#                             OpenMP and CUDA as EPX_HAVE_OPENMP and EPX_HAVE_CUDA say
#   -DEXPECT_EPX_CONFIGURE_ERROR=text  with INSTALL_CONFIGURE_FLAGS: that configure must
#                             fail, its stderr containing text (nothing is installed)
cmake_minimum_required(VERSION 3.25)

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(run_rc "${rc}" PARENT_SCOPE)
  set(run_out "${out}" PARENT_SCOPE)
  set(run_err "${err}" PARENT_SCOPE)
  if(NOT rc EQUAL 0 AND NOT what STREQUAL "may-fail")
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
set(extra)

if(MODE STREQUAL "find_package")
  set(install_from ${EPX_BINARY_DIR})
  if(DEFINED INSTALL_CONFIGURE_FLAGS)
    # Config-mode find_package looks only under an empty root: doctest and Google Benchmark
    # are not found, as on a machine that lacks them.
    separate_arguments(flags UNIX_COMMAND "${INSTALL_CONFIGURE_FLAGS}")
    set(install_from ${WORK_DIR}/epx-build)
    file(MAKE_DIRECTORY ${WORK_DIR}/no-packages)
    set(epx_configure ${CMAKE_COMMAND} -S ${EPX_SOURCE_DIR} -B ${install_from}
        -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX} ${flags}
        -DCMAKE_FIND_ROOT_PATH=${WORK_DIR}/no-packages -DCMAKE_FIND_ROOT_PATH_MODE_PACKAGE=ONLY
        -DEPX_ENABLE_OPENMP=${EPX_HAVE_OPENMP} -DEPX_ENABLE_CUDA=${EPX_HAVE_CUDA})
    if(DEFINED EXPECT_EPX_CONFIGURE_ERROR)
      run("may-fail" ${epx_configure})
      if(run_rc EQUAL 0)
        message(FATAL_ERROR "configuring epx (${INSTALL_CONFIGURE_FLAGS}) succeeded but was expected to fail")
      endif()
      string(FIND "${run_err}" "${EXPECT_EPX_CONFIGURE_ERROR}" at)
      if(at EQUAL -1)
        message(FATAL_ERROR "configuring epx failed, but stderr lacks '${EXPECT_EPX_CONFIGURE_ERROR}':\n${run_err}")
      endif()
      message(STATUS "configuring epx failed as expected:\n${run_err}")
      return()
    endif()
    run("configure epx (${INSTALL_CONFIGURE_FLAGS})" ${epx_configure})
  endif()
  run("install" ${CMAKE_COMMAND} --install ${install_from} --prefix ${prefix})
  foreach(f IN ITEMS include/epx/epx.hpp include/epx/mesh/mesh.hpp share/epx/cmake/epxConfig.cmake
                     share/epx/cmake/epxConfigVersion.cmake share/epx/cmake/epxTargets.cmake)
    if(NOT EXISTS ${prefix}/${f})
      message(FATAL_ERROR "install is missing ${f}")
    endif()
  endforeach()
  # An install made with CUDA must export epx::cuda too.
  list(APPEND extra -DCMAKE_PREFIX_PATH=${prefix} -DEPX_CONSUMER_EXPECT_CUDA=${EPX_HAVE_CUDA})
  # The installed package must not point back into the source or build tree.
  file(GLOB cfgs ${prefix}/share/epx/cmake/*.cmake)
  foreach(f IN LISTS cfgs)
    file(READ ${f} text)
    string(FIND "${text}" "${EPX_SOURCE_DIR}/include" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "${f} refers to the source tree")
    endif()
  endforeach()
endif()
if(VERSION)
  list(APPEND extra -DEPX_CONSUMER_VERSION=${VERSION})
endif()
if(EPX_PROJECT_VERSION)
  list(APPEND extra -DEPX_CONSUMER_EXPECT_VERSION=${EPX_PROJECT_VERSION})
endif()
if(NOT DEFINED CUDA_OPENMP)
  if(MODE STREQUAL "find_package" AND EPX_HAVE_CUDA)
    set(CUDA_OPENMP ON)
  else()
    set(CUDA_OPENMP OFF)
  endif()
endif()
list(APPEND extra -DEPX_CONSUMER_CUDA_OPENMP=${CUDA_OPENMP})
if(EPX_HAVE_OPENMP)
  list(APPEND extra -DEPX_CONSUMER_EXPECT_OPENMP=ON)
  set(want_openmp "exec::openmp: parallel, 2 threads\ndefault_chunks(exec::openmp{}): 3\n")
  if(CUDA_OPENMP)
    string(APPEND want_openmp ".cu source: exec::openmp: parallel, 2 threads\n"
                              ".cu source: default_chunks(exec::openmp{}): 3\n")
  endif()
else()
  list(APPEND extra -DEPX_CONSUMER_EXPECT_OPENMP=OFF)
  set(want_openmp "exec::openmp: serial\ndefault_chunks(exec::openmp{}): 1\n")
  if(CUDA_OPENMP)
    string(APPEND want_openmp ".cu source: exec::openmp: serial\n"
                              ".cu source: default_chunks(exec::openmp{}): 1\n")
  endif()
  if(NOT MODE STREQUAL "find_package")
    # The epx under test has no OpenMP: the nested epx must not look for it either.
    list(APPEND extra -DEPX_ENABLE_OPENMP=OFF)
  endif()
endif()

if(DEFINED EPX_ENABLE_CUDA)
  list(APPEND extra -DEPX_ENABLE_CUDA=${EPX_ENABLE_CUDA})
endif()

set(configure ${CMAKE_COMMAND} -S ${CMAKE_CURRENT_LIST_DIR}/consumer -B ${WORK_DIR}/build -G ${GENERATOR}
    -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=Release -DEPX_CONSUMER_MODE=${MODE}
    -DEPX_CONSUMER_SOURCE_DIR=${EPX_SOURCE_DIR} ${extra})
if(EXPECT_CONFIGURE_FAILURE)
  run("may-fail" ${configure})
  if(run_rc EQUAL 0)
    message(FATAL_ERROR "configure succeeded but was expected to fail:\n${run_out}")
  endif()
  string(FIND "${run_err}" "requested version" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "configure failed, but not for the version:\n${run_err}")
  endif()
  message(STATUS "configure failed as expected:\n${run_err}")
  return()
endif()
string(TIMESTAMP t0 "%s")
run("configure" ${configure})
string(TIMESTAMP t1 "%s")
math(EXPR configure_s "${t1} - ${t0}")
message(STATUS "${run_out}")
message(STATUS "consumer configure (${MODE}): about ${configure_s} s")

# A nested epx with its defaults must not probe for CUDA (check_language runs nvcc; the
# CCCL headers, which only its tests use, are not looked for either) or MPI
# (FindMPI runs the wrappers): both options default to OFF when epx is not the top level.
if(NOT MODE STREQUAL "find_package" AND NOT DEFINED EPX_ENABLE_CUDA)
  file(STRINGS ${WORK_DIR}/build/CMakeCache.txt cache)
  foreach(want IN ITEMS "EPX_ENABLE_CUDA:BOOL=OFF" "EPX_ENABLE_MPI:BOOL=OFF")
    if(NOT want IN_LIST cache)
      message(FATAL_ERROR "the consumer's cache lacks ${want}: a nested epx must default to it")
    endif()
  endforeach()
  set(probed)
  foreach(line IN LISTS cache)
    if(line MATCHES "^(CMAKE_CUDA_[A-Z_]*|CUDAToolkit_[A-Za-z_]*|EPX_NCCL_[A-Z_]*|EPX_CCCL_[A-Z_]*|MPI_[A-Za-z_]*|MPIEXEC_[A-Z_]*)(:[A-Z]+)?=")
      list(APPEND probed "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  if(probed)
    message(FATAL_ERROR "a nested epx probed for CUDA, CCCL or MPI; cache entries: ${probed}")
  endif()
  foreach(msg IN ITEMS "Looking for a CUDA compiler" "Found MPI" "Could NOT find MPI")
    string(FIND "${run_out}${run_err}" "${msg}" at)
    if(NOT at EQUAL -1)
      message(FATAL_ERROR "a nested epx probed for CUDA or MPI ('${msg}'):\n${run_out}")
    endif()
  endforeach()
endif()
run("build" ${CMAKE_COMMAND} --build ${WORK_DIR}/build -j2)
# OMP_THREAD_LIMIT or OMP_DYNAMIC in the environment could hold the team below 2 threads;
# OMP_NUM_THREADS=3 fixes the OpenMP default that default_chunks reports.
run("run" ${CMAKE_COMMAND} -E env --unset=OMP_THREAD_LIMIT --unset=OMP_DYNAMIC OMP_NUM_THREADS=3
    ${WORK_DIR}/build/epx_consumer)
file(READ ${EXPECT} want)
string(APPEND want "${want_openmp}")
if(NOT run_out STREQUAL want)
  message(FATAL_ERROR "consumer output differs; got:\n${run_out}\nexpected:\n${want}")
endif()
message(STATUS "consumer (${MODE}) output:\n${run_out}")

# find_package(epx) with components, against an install of a configured epx build (cmake -P):
#   -DEPX_BINARY_DIR=<configured epx build>  -DWORK_DIR=<scratch dir>
#   -DGENERATOR=<cmake generator>  -DCXX=<C++ compiler>
#   -DEPX_HAVE_CUDA=ON|OFF  whether that build provides epx::cuda
# Each case configures a small project (nothing is built) and checks what find_package set:
#   - an unknown component is refused when required (the message names it), and is
#     merely not found when optional;
#   - cuda, asked for, is found with epx::cuda where the build has CUDA; where it has not,
#     or where the CUDA toolkit is not found (CMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit
#     stands in for a machine without one), epx_FOUND is false with a message that says
#     why, and REQUIRED stops the configure with it;
#   - without components, or with cuda optional, a missing toolkit costs only epx::cuda.
cmake_minimum_required(VERSION 3.25)

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
execute_process(COMMAND ${CMAKE_COMMAND} --install ${EPX_BINARY_DIR} --prefix ${prefix}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install failed (${rc}):\n${out}\n${err}")
endif()

# check(<name> <find_package arguments> [EXPECT_FAILURE <text>] [EXPECT <text>...] [ARGS <-D...>])
# EXPECT: what the project must print after "-- check: " ("epx_FOUND=1", "epx::cuda=0").
function(check name)
  cmake_parse_arguments(PARSE_ARGV 1 a "" "FIND;EXPECT_FAILURE" "EXPECT;ARGS")
  set(dir ${WORK_DIR}/${name})
  file(WRITE ${dir}/CMakeLists.txt "cmake_minimum_required(VERSION 3.25)
project(epx_components LANGUAGES CXX)
find_package(epx CONFIG ${a_FIND})
foreach(v IN ITEMS epx_FOUND epx_cuda_FOUND epx_nosuch_FOUND)
  if(\${v})
    message(STATUS \"check: \${v}=1\")
  else()
    message(STATUS \"check: \${v}=0\")
  endif()
endforeach()
foreach(t IN ITEMS epx::epx epx::cuda)
  if(TARGET \${t})
    message(STATUS \"check: \${t}=1\")
  else()
    message(STATUS \"check: \${t}=0\")
  endif()
endforeach()
message(STATUS \"check: message=\${epx_NOT_FOUND_MESSAGE}\")
")
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${dir} -B ${dir}/build -G ${GENERATOR}
                          -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_PREFIX_PATH=${prefix} ${a_ARGS}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  # CMake wraps its messages: compare with every run of white space as one space.
  string(REGEX REPLACE "[ \t\r\n]+" " " flat_out "${out}")
  string(REGEX REPLACE "[ \t\r\n]+" " " flat_err "${err}")
  if(DEFINED a_EXPECT_FAILURE)
    if(rc EQUAL 0)
      message(FATAL_ERROR "[${name}] find_package(epx ${a_FIND}) succeeded but was expected to fail:\n${out}")
    endif()
    string(FIND "${flat_err}" "${a_EXPECT_FAILURE}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "[${name}] the configure failed, but its stderr lacks '${a_EXPECT_FAILURE}':\n${err}")
    endif()
    message(STATUS "[${name}] failed as expected")
    return()
  endif()
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "[${name}] find_package(epx ${a_FIND}) failed (${rc}):\n${out}\n${err}")
  endif()
  foreach(want IN LISTS a_EXPECT)
    string(FIND "${flat_out}" "-- check: ${want}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "[${name}] find_package(epx ${a_FIND}): expected 'check: ${want}' in:\n${out}")
    endif()
  endforeach()
  message(STATUS "[${name}] ok")
endfunction()

set(no_toolkit -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON)
set(no_cuda_why "this epx was installed without it")
if(EPX_HAVE_CUDA)
  set(no_cuda_why "the CUDA toolkit was not found")
endif()

check(unknown_required FIND "REQUIRED;COMPONENTS;nosuch" EXPECT_FAILURE "epx has no component 'nosuch'")
check(unknown_required_beside_cuda FIND "REQUIRED;COMPONENTS;cuda;nosuch" EXPECT_FAILURE "epx has no component 'nosuch'")
check(unknown_optional FIND "OPTIONAL_COMPONENTS;nosuch" EXPECT epx_FOUND=1 epx_nosuch_FOUND=0 epx::epx=1)
check(none_without_toolkit FIND "REQUIRED" ARGS ${no_toolkit}
      EXPECT epx_FOUND=1 epx_cuda_FOUND=0 epx::epx=1 epx::cuda=0)
check(cuda_without_toolkit FIND "COMPONENTS;cuda" ARGS ${no_toolkit}
      EXPECT epx_FOUND=0 epx_cuda_FOUND=0 epx::cuda=0
             "message=epx component cuda (epx::cuda) is not available: ${no_cuda_why}")
check(cuda_required_without_toolkit FIND "REQUIRED;COMPONENTS;cuda" ARGS ${no_toolkit}
      EXPECT_FAILURE "epx component cuda (epx::cuda) is not available: ${no_cuda_why}")
check(cuda_optional_without_toolkit FIND "REQUIRED;OPTIONAL_COMPONENTS;cuda" ARGS ${no_toolkit}
      EXPECT epx_FOUND=1 epx_cuda_FOUND=0 epx::epx=1 epx::cuda=0)
if(EPX_HAVE_CUDA)
  check(cuda FIND "REQUIRED;COMPONENTS;cuda" EXPECT epx_FOUND=1 epx_cuda_FOUND=1 epx::epx=1 epx::cuda=1)
  check(none FIND "REQUIRED" EXPECT epx_FOUND=1 epx_cuda_FOUND=1 epx::cuda=1)
else()
  check(cuda FIND "COMPONENTS;cuda"
        EXPECT epx_FOUND=0 epx_cuda_FOUND=0 epx::cuda=0
               "message=epx component cuda (epx::cuda) is not available: this epx was installed without it")
  check(cuda_required FIND "REQUIRED;COMPONENTS;cuda" EXPECT_FAILURE "this epx was installed without it")
endif()

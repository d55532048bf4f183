# epx_openmp_cuda_option(<out-var> <flags>): the compile option that gives CUDA sources
# compiled by nvcc the host compiler's OpenMP flags <flags> (OpenMP_CXX_FLAGS, e.g.
# -fopenmp), as a generator expression for INTERFACE_COMPILE_OPTIONS:
#   $<$<COMPILE_LANG_AND_ID:CUDA,NVIDIA>:-Xcompiler=<flag>[,<flag>...]>
# so that exec::openmp is parallel in .cu sources too and every translation unit of a
# program agrees on EPX_HAS_OPENMP (epx/core/config.hpp); nothing for Clang as the CUDA
# compiler. It assumes that nvcc's host compiler (CMAKE_CUDA_HOST_COMPILER) takes the C++
# compiler's OpenMP flags, as it does when both are the same compiler (the usual setup).
# Used by epx's CMakeLists.txt for the build tree and by the installed package
# configuration for the consumer's compiler.
function(epx_openmp_cuda_option out flags)
  separate_arguments(list NATIVE_COMMAND "${flags}")
  if(NOT list)
    set(${out} "" PARENT_SCOPE)
    return()
  endif()
  list(JOIN list "," joined)
  set(${out} "$<$<COMPILE_LANG_AND_ID:CUDA,NVIDIA>:-Xcompiler=${joined}>" PARENT_SCOPE)
endfunction()

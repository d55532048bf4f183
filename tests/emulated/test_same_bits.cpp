// The same-bits matrix of tests/core/test_same_bits.cpp with the device's algorithm
// variants (EPX_EMULATE_DEVICE_ALGORITHMS=1: capacity's 8-bit digits) on every policy, and
// exec::emulated_device planning with Thrust's stable sort where the CCCL headers are there
// (EPX_HAS_CCCL), against the counting sort of exec::serial and exec::openmp.
#define EPX_TEST_EXEC ::epx::exec::emulated_device
#include "core/test_same_bits.cpp"

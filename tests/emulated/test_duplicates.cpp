// The duplicate-id cases of tests/core/test_duplicates.cpp on exec::emulated_device: tokens
// that name one expert in several slots through the device path, run on the CPU.
#define EPX_TEST_EXEC ::epx::exec::emulated_device
#include "core/test_duplicates.cpp"

// Bounded mode (tests/core/test_bounded.cpp) on exec::emulated_device: the staged route with
// device buffers and the device launch shape, bitwise the normal mode and against the
// float64 reference.
#define EPX_TEST_EXEC ::epx::exec::emulated_device
#include "core/test_bounded.cpp"

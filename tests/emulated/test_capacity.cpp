// The capacity tests of tests/core/test_capacity.cpp on exec::emulated_device: token
// dropping on the device path (staged route, device buffers, functors in reverse order).
#define EPX_TEST_EXEC ::epx::exec::emulated_device
#include "core/test_capacity.cpp"

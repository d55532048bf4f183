// The split-phase tests of tests/core/test_split.cpp on exec::emulated_device (the device
// path on the CPU: staged route, device buffers, the device synchronisation points).
#define EPX_TEST_EXEC ::epx::exec::emulated_device
#include "core/test_split.cpp"

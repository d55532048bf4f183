// The layer at H = 300, 4096 and 7168 of tests/core/test_layer_sizes.cpp on
// exec::emulated_device: the device path (staged route, device buffers, 16-byte chunk
// launches) against the float64 reference with the same derived error bounds.
#define EPX_TEST_EXEC ::epx::exec::emulated_device
#include "core/test_layer_sizes.cpp"

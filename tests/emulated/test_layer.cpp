// The layer test matrix of tests/core/test_layer.cpp on exec::emulated_device: the device
// path (staged route, device buffers, the 16-byte chunk launch shape, the device
// synchronisation points) run on the CPU against the float64 reference.
#define EPX_TEST_EXEC ::epx::exec::emulated_device
#include "core/test_layer.cpp"

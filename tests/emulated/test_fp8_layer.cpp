// The FP8-dispatch layer tests of tests/core/test_fp8_layer.cpp on exec::emulated_device.
#define EPX_TEST_EXEC ::epx::exec::emulated_device
#include "core/test_fp8_layer.cpp"

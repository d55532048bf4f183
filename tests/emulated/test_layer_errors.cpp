// The bad-input tests of tests/core/test_layer_errors.cpp on exec::emulated_device: the
// bad-pair flag found on the device, carried in the count exchange's record, raises on
// every rank of the EP group with the same message, and nobody hangs.
#define EPX_TEST_EXEC ::epx::exec::emulated_device
#include "core/test_layer_errors.cpp"

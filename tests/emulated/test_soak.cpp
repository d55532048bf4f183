// The soak of tests/reliability/test_soak.cpp on exec::emulated_device: random layer steps
// on the device path, run on the CPU, against the float64 reference.
#define EPX_TEST_EXEC ::epx::exec::emulated_device
#include "reliability/test_soak.cpp"

// The fp16 tests of tests/core/test_fp16.cpp on exec::emulated_device: bounded mode, the
// split-phase calls and FP8 dispatch of fp16 rows against the float64 reference within the
// bounds derived from fp16's precision, and results beyond 65504 as infinities (that test
// runs every policy itself, the emulated device included).
#define EPX_TEST_EXEC ::epx::exec::emulated_device
#include "core/test_fp16.cpp"

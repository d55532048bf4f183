// The routing tests of tests/core/test_node_limit.cpp in the variant a GPU runs
// (EPX_DEVICE_ALGORITHMS, set for the emulated label): no key tables, every key offered to
// the selection, against the same float64 reference and bit-for-bit expectations.
#include "core/test_node_limit.cpp"

// Compiled with -ffast-math, epx warns that its NaN/infinity handling and bitwise
// guarantees need IEEE-754 arithmetic (epx/core/config.hpp); EPX_ALLOW_FAST_MATH silences it.
#include "epx/epx.hpp"

int main() { return 0; }

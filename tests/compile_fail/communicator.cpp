// A communicator without all_gather: check_communicator names the missing call. Without
// EPX_COMPILE_FAIL the type has it and meets the concept.
#include "my_comm.hpp"

static_assert(epx::check_communicator<my_comm>(), "my_comm is not a communicator");

int main() { return 0; }

// epx/layer/experts.hpp: kept for one release; the header is epx/impl/experts.hpp (see CHANGELOG.md).
#pragma once

#include "epx/impl/experts.hpp"

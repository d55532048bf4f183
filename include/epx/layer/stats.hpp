// epx/layer/stats.hpp: kept for one release; the header is epx/impl/stats.hpp (see CHANGELOG.md).
#pragma once

#include "epx/impl/stats.hpp"

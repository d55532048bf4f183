// epx/layer/options.hpp: kept for one release; the header is epx/impl/options.hpp (see CHANGELOG.md).
#pragma once

#include "epx/impl/options.hpp"

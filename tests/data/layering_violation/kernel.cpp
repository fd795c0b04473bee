// Fixture for tests/cmake/check_layering.cmake: reaches a runtime header through local_interface.h.
#include <string>

#include "local_interface.h"

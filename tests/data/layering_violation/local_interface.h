// Fixture for tests/cmake/check_layering.cmake: the runtime header hidden one level down.
#pragma once
#include "metile/codegen.h"
#include "metile/attention_runtime.h"

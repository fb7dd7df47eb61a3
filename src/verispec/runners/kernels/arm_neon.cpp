#include "core.h"
namespace vsk {
void tile_neon(int64_t, const TileArgs&) { fail("todo"); }
void quantize_block_neon(const float*, int, int8_t*, float*) { fail("todo"); }
void fit_iq4_nl_neon(const float*, const float*, float, float&, float&) { fail("todo"); }
void scores_neon(const float*, int, const float*, int64_t, const int64_t*, int64_t, float, float*) { fail("todo"); }
void weighted_sum_neon(const float*, int, const float*, int64_t, const int64_t*, int64_t, float*) { fail("todo"); }
}

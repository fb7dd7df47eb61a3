#include "core.h"
namespace vsk {
void tile_avx2(int64_t, const TileArgs&, bool) { fail("todo"); }
void quantize_block_avx2(const float*, int, int8_t*, float*) { fail("todo"); }
void fit_iq4_nl_avx2(const float*, const float*, float, float&, float&) { fail("todo"); }
void scores_avx2(const float*, int, const float*, int64_t, const int64_t*, int64_t, float, float*) { fail("todo"); }
void weighted_sum_avx2(const float*, int, const float*, int64_t, const int64_t*, int64_t, float*) { fail("todo"); }
}

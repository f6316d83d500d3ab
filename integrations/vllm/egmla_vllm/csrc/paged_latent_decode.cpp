// One new token per request attends over its cached latent rows, read in place from vLLM's paged cache: the query
// heads of a request share every row (one key head, MQA), so each row is read once for all of them. The work is cut
// into chunks of a request's context, each chunk's softmax kept as (max, sum, weighted values) and the chunks merged
// per request, so that one long request and many short ones alike keep every core busy. fp32 (vLLM's CPU latent
// kernels serve bf16 and fp16), and any dtype where a key's score is multiplied by its cached key-norm scale
// (`qk_norm`, which vLLM's kernels cannot do) or a windowed layer reads only its window's last rows. The rows are
// read in their dtype and computed on in fp32.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kChunk = 256;  // cached rows per work item: a chunk's rows stay in cache for the values' pass

// e^x for x <= 0 in a form the compiler vectorizes (std::exp is a scalar call per score, which would dominate the
// softmax): x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor series to r^7 (within float's rounding), 2^n
// written into the exponent's bits.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);  // keeps 2^n a normal float; a weight this small is 0 beside the largest one's 1
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = x - n * 0.693145752f - n * 1.42860677e-6f;  // ln 2 in two parts: r exact to float's precision
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

struct Layout {
  int64_t heads, width, values, block_size, block_stride, table_stride;
  int64_t row_width;     // the cached row's columns; the scores read its first `width`, the values its first `values`
  int64_t scale_column;  // where the row's key-norm scales start (-1: none), one per key-norm head
  int64_t scale_heads;   // key-norm heads: query head h takes scale h / (heads / scale_heads)
};

// One work item: rows [start, end) of a request whose block table row is `table`.
struct Chunk {
  const int64_t* table;
  int64_t start, end;
};

// Rows [start, end) of one request: each head's max score, sum of exponentials and weighted values, written to
// `partial` [heads, values + 2] as (values..., max, sum). The chunk's rows are copied next to each other in fp32 (they
// stay in cache) so that the scores and the values are two matrix products.
template <typename scalar_t>
void attend_chunk(const float* query, const scalar_t* cache, const Chunk& chunk, float scale, const Layout& layout,
                  float* partial, std::vector<float>& buffer) {
  const int64_t rows = chunk.end - chunk.start, heads = layout.heads, values = layout.values, width = layout.width;
  if (rows == 0) {  // an empty request: no weight, no value
    for (int64_t h = 0; h < heads; ++h) {
      std::fill(partial + h * (values + 2), partial + h * (values + 2) + values, 0.f);
      partial[h * (values + 2) + values] = -std::numeric_limits<float>::infinity();
      partial[h * (values + 2) + values + 1] = 0.f;
    }
    return;
  }
  const int64_t scale_heads = layout.scale_column < 0 ? 0 : layout.scale_heads;
  buffer.resize(rows * width + heads * rows + heads * values + rows * scale_heads);
  float* gathered = buffer.data();
  float* scores = gathered + rows * width;
  float* weighted = scores + heads * rows;
  float* key_scales = weighted + heads * values;
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t position = chunk.start + t;
    const scalar_t* row = cache + chunk.table[position / layout.block_size] * layout.block_stride +
                          (position % layout.block_size) * layout.row_width;
    float* target = gathered + t * width;
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) target[c] = static_cast<float>(row[c]);
    for (int64_t g = 0; g < scale_heads; ++g) key_scales[t * scale_heads + g] = static_cast<float>(row[layout.scale_column + g]);
  }
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const auto row_tensor = at::from_blob(gathered, {rows, width}, options);
  auto score_tensor = at::from_blob(scores, {heads, rows}, options);
  at::mm_out(score_tensor, at::from_blob(const_cast<float*>(query), {heads, width}, options), row_tensor.t());
  for (int64_t h = 0; h < heads; ++h) {
    float* score = scores + h * rows;
    if (scale_heads) {  // a key's score times its key-norm scale: the score of the normed key
      const float* by_row = key_scales + h / (heads / scale_heads);
      for (int64_t t = 0; t < rows; ++t) score[t] *= by_row[t * scale_heads];
    }
    const float high = *std::max_element(score, score + rows) * scale;  // scale > 0
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < rows; ++t) {
      score[t] = exp_nonpositive(score[t] * scale - high);
      sum += score[t];
    }
    partial[h * (values + 2) + values] = high;
    partial[h * (values + 2) + values + 1] = sum;
  }
  auto weighted_tensor = at::from_blob(weighted, {heads, values}, options);
  at::mm_out(weighted_tensor, score_tensor, row_tensor.narrow(1, 0, values));
  for (int64_t h = 0; h < heads; ++h) std::copy_n(weighted + h * values, values, partial + h * (values + 2));
}

// The chunks of one request merged into its output [heads, values] (row stride `out_stride`).
void merge_chunks(const float* partials, int64_t chunks, const Layout& layout, float* out, int64_t out_stride) {
  const int64_t heads = layout.heads, values = layout.values, item = heads * (values + 2);
  for (int64_t h = 0; h < heads; ++h) {
    float high = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < chunks; ++c) high = std::max(high, partials[c * item + h * (values + 2) + values]);
    float total = 0.f;
    float* target = out + h * out_stride;
    std::fill(target, target + values, 0.f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* part = partials + c * item + h * (values + 2);
      const float weight = part[values + 1] > 0.f ? std::exp(part[values] - high) : 0.f;
      total += weight * part[values + 1];
#pragma omp simd
      for (int64_t v = 0; v < values; ++v) target[v] += weight * part[v];
    }
    const float inverse = total > 0.f ? 1.f / total : 0.f;
    for (int64_t v = 0; v < values; ++v) target[v] *= inverse;
  }
}

}  // namespace

template <typename scalar_t>
void decode_requests(const at::Tensor& query, const at::Tensor& cache, const at::Tensor& table,
                     const at::Tensor& lengths, double scale, int64_t window, const Layout& layout, at::Tensor out) {
  const int64_t requests = query.size(0);
  const int64_t* length = lengths.data_ptr<int64_t>();
  std::vector<int64_t> first_row(requests), first_chunk(requests + 1, 0);  // each request's chunks, numbered across
  for (int64_t r = 0; r < requests; ++r) {                                  // the batch
    first_row[r] = window > 0 ? std::max<int64_t>(0, length[r] - window) : 0;  // a window reads its last rows only
    first_chunk[r + 1] = first_chunk[r] + std::max<int64_t>(1, (length[r] - first_row[r] + kChunk - 1) / kChunk);
  }
  const int64_t chunks = first_chunk[requests], item = layout.heads * (layout.values + 2);
  std::vector<float> partials(chunks * item);
  const float* query_data = query.data_ptr<float>();
  const scalar_t* cache_data = cache.data_ptr<scalar_t>();
  const int64_t* table_data = table.data_ptr<int64_t>();
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t r = std::upper_bound(first_chunk.begin(), first_chunk.end(), chunk) - first_chunk.begin() - 1;
      const int64_t start = first_row[r] + (chunk - first_chunk[r]) * kChunk, stop = std::min(length[r], start + kChunk);
      const Chunk rows{table_data + r * layout.table_stride, start, stop};
      attend_chunk(query_data + r * layout.heads * layout.width, cache_data, rows, static_cast<float>(scale), layout,
                   partials.data() + chunk * item, buffer);
    }
  });
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, requests, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      merge_chunks(partials.data() + first_chunk[r] * item, first_chunk[r + 1] - first_chunk[r], layout,
                   out_data + r * out.stride(0), out.stride(1));
  });
}

// query [B, H, Dq] (fp32), cache [blocks, block_size, D] (rows contiguous, fp32, bf16 or fp16), block_table
// [B, max_blocks], seq_lens [B]; writes out [B, H, V] (fp32; V <= Dq <= D: the scores read each row's first Dq
// columns, its value is its first V). `scale_column` >= 0: each score times the row's key-norm scale at that column
// (+ h / (H / scale_heads) for query head h). `window` > 0: each request attends over its last `window` rows only.
void paged_latent_decode(const at::Tensor& query, const at::Tensor& cache, const at::Tensor& block_table,
                         const at::Tensor& seq_lens, double scale, at::Tensor out, int64_t scale_column,
                         int64_t scale_heads, int64_t window) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_latent_decode: float32 queries and output");
  TORCH_CHECK(query.dim() == 3 && cache.dim() == 3 && out.dim() == 3, "paged_latent_decode: [B, H, D] queries");
  TORCH_CHECK(query.is_contiguous() && cache.stride(2) == 1 && cache.stride(1) == cache.size(2),
              "paged_latent_decode: contiguous queries and cache rows");
  TORCH_CHECK(out.stride(2) == 1 && out.size(2) <= query.size(2) && query.size(2) <= cache.size(2),
              "paged_latent_decode: output [B, H, V] with V <= Dq <= D");
  TORCH_CHECK(scale_column < 0 || (scale_heads > 0 && query.size(1) % scale_heads == 0 &&
                                   scale_column + scale_heads <= cache.size(2)),
              "paged_latent_decode: key-norm scales inside the row, a whole number of query heads each");
  TORCH_CHECK(query.device().is_cpu() && cache.device().is_cpu() && out.device().is_cpu(), "paged_latent_decode: CPU");
  TORCH_CHECK(block_table.dim() == 2 && seq_lens.dim() == 1 && block_table.size(0) == query.size(0) &&
                  seq_lens.size(0) == query.size(0) && out.size(0) == query.size(0) && out.size(1) == query.size(1),
              "paged_latent_decode: one block table row, length and output per request");
  TORCH_CHECK(seq_lens.numel() == 0 || seq_lens.max().item<int64_t>() <= block_table.size(1) * cache.size(1),
              "paged_latent_decode: a request longer than its block table");
  const auto table = block_table.to(at::kLong).contiguous();
  const auto lengths = seq_lens.to(at::kLong).contiguous();
  const Layout layout{query.size(1), query.size(2), out.size(2), cache.size(1), cache.stride(0), table.stride(0),
                      cache.size(2), scale_column, scale_heads};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache.scalar_type(), "paged_latent_decode", [&] {
    decode_requests<scalar_t>(query, cache, table, lengths, scale, window, layout, out);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("paged_latent_decode", &paged_latent_decode,
             "MQA decode over a paged latent cache, with key-norm scales and a window where given");
}

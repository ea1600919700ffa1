// The CPU kernels of ops.cc's operators: float32 arithmetic (float64 sums), one rounding to the tensors' dtype,
// rows shared among the machine's cores.
#pragma once

#include <math.h>
#include <stdint.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "gelu.h"
#include "half.h"
#include "kernels.h"
#include "philox.h"

namespace ort_trainer_kernels {

struct F32 {
  using Storage = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
struct F16 {
  using Storage = uint16_t;
  static float load(uint16_t v) { return float16_to_float(v); }
  static uint16_t store(float v) { return float_to_float16(v); }
};
struct BF16 {
  using Storage = uint16_t;
  static float load(uint16_t v) { return bfloat16_to_float(v); }
  static uint16_t store(float v) { return float_to_bfloat16(v); }
};

// run(begin, end) over [0, items) split among the machine's cores, where each share has at least `grain` items
// (ONNX Runtime's own threads wait while a custom kernel runs); the shares and their order depend only on `items`
// and the core count
template <typename Run>
void parallel(int64_t items, int64_t grain, Run&& run) {
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t shares = std::max<int64_t>(1, std::min(cores, items / std::max<int64_t>(grain, 1)));
  if (shares == 1) {
    run(int64_t{0}, items);
    return;
  }
  std::vector<std::thread> threads;
  const int64_t step = (items + shares - 1) / shares;
  for (int64_t begin = step; begin < items; begin += step)
    threads.emplace_back([&run, begin, step, items] { run(begin, std::min(items, begin + step)); });
  run(int64_t{0}, std::min(items, step));
  for (auto& thread : threads) thread.join();
}

constexpr int64_t kGrain = 1 << 16;  // elements of a share: below that, starting a thread costs more than it saves

// calls run.template operator()<F32 / F16 / BF16>() for `type`
template <typename Run>
void dispatch(ElementType type, Run&& run) {
  switch (type) {
    case ElementType::kFloat: run.template operator()<F32>(); break;
    case ElementType::kFloat16: run.template operator()<F16>(); break;
    case ElementType::kBFloat16: run.template operator()<BF16>(); break;
  }
}

template <typename T, bool kTanh>
void gelu_grad_cpu(const void* dy, const void* x, void* dx, int64_t n) {
  using S = typename T::Storage;
  const S *a = static_cast<const S*>(dy), *b = static_cast<const S*>(x);
  S* out = static_cast<S*>(dx);
  parallel(n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float v = T::load(b[i]);
      out[i] = T::store(T::load(a[i]) * (kTanh ? gelu_tanh_derivative(v) : gelu_erf_derivative(v)));
    }
  });
}

// LayerNorm's backward (layer_norm.h), one chunk: partials [1, 2, cols] hold dgamma and dbeta's float32 sums (the
// float64 sums of each core's share of rows, added in order). dy in D; with a residual (nullptr: none), dx is the
// residual + the gradient rounded to T, one add in float32 as an Add node computes it; with dx_cast (nullptr: none),
// dx rounded to C as well
template <typename T, typename G, typename D, typename C = D>
void layer_norm_grad_cpu(const void* dy_, const void* x_, const void* mean_, const void* rstd_, const void* gamma_,
                         const void* residual_, void* dx_, void* dx_cast_, void* dgamma_, void* dbeta_,
                         float* partials, int64_t rows, int64_t cols) {
  using S = typename T::Storage;
  using GS = typename G::Storage;
  using DS = typename D::Storage;
  using CS = typename C::Storage;
  const DS* dy = static_cast<const DS*>(dy_);
  const S *x = static_cast<const S*>(x_), *residual = static_cast<const S*>(residual_);
  const S *mean = static_cast<const S*>(mean_), *rstd = static_cast<const S*>(rstd_);
  const GS* gamma = static_cast<const GS*>(gamma_);
  S* dx = static_cast<S*>(dx_);
  CS* dx_cast = static_cast<CS*>(dx_cast_);
  // each share of rows sums its own columns; the shares' sums are added in order
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1));
  const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t step = std::max<int64_t>(grain, (rows + cores - 1) / cores);
  const int64_t shares = std::max<int64_t>(1, (rows + step - 1) / step);
  std::vector<double> sums(static_cast<size_t>(shares * 2 * cols), 0.0);
  parallel(shares, 1, [&](int64_t first, int64_t last) {
    for (int64_t share = first; share < last; ++share) {
      double *sum_g = sums.data() + share * 2 * cols, *sum_b = sum_g + cols;
      for (int64_t row = share * step; row < std::min(rows, (share + 1) * step); ++row) {
        const DS* d = dy + row * cols;
        const S* v = x + row * cols;
        const double m = T::load(mean[row]), r = T::load(rstd[row]);
        double s_g = 0.0, s_gx = 0.0;
        for (int64_t c = 0; c < cols; ++c) {
          const double dv = D::load(d[c]), xhat = (T::load(v[c]) - m) * r, g = dv * G::load(gamma[c]);
          s_g += g;
          s_gx += g * xhat;
          sum_g[c] += dv * xhat;
          sum_b[c] += dv;
        }
        const double mean_g = s_g / cols, mean_gx = s_gx / cols;
        S* out = dx + row * cols;
        for (int64_t c = 0; c < cols; ++c) {
          const double xhat = (T::load(v[c]) - m) * r, g = D::load(d[c]) * static_cast<double>(G::load(gamma[c]));
          out[c] = T::store(static_cast<float>(r * (g - mean_g - xhat * mean_gx)));
          // float32, as the Add node's
          if (residual != nullptr) out[c] = T::store(T::load(residual[row * cols + c]) + T::load(out[c]));
          if (dx_cast != nullptr) dx_cast[row * cols + c] = C::store(T::load(out[c]));
        }
      }
    }
  });
  GS *dgamma = static_cast<GS*>(dgamma_), *dbeta = static_cast<GS*>(dbeta_);
  for (int64_t c = 0; c < cols; ++c) {
    double g = 0.0, b = 0.0;
    for (int64_t share = 0; share < shares; ++share) {
      g += sums[share * 2 * cols + c];
      b += sums[share * 2 * cols + cols + c];
    }
    partials[c] = static_cast<float>(g);
    partials[cols + c] = static_cast<float>(b);
    dgamma[c] = G::store(partials[c]);
    dbeta[c] = G::store(partials[cols + c]);
  }
}

// LayerNorm's forward over rows of `cols` float32 values: each row's mean and rstd (float64 sums, rounded to
// float32), y = (x - mean) * rstd * gamma + beta computed in float64, rounded to float32 (written to y32 where it is
// not null), then to the half dtype H. Where branch (of H) is not null, the rows normalized are x + branch, one
// float32 add an element (as an Add of x and a Cast of branch), written to sum
template <typename H>
void layer_norm_cast_cpu(const float* x, const void* branch_, float* sum, const float* gamma, const float* beta,
                         void* y_, float* y32, float* mean, float* rstd, int64_t rows, int64_t cols, float epsilon) {
  typename H::Storage* y = static_cast<typename H::Storage*>(y_);
  const typename H::Storage* branch = static_cast<const typename H::Storage*>(branch_);
  parallel(rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* v = x + row * cols;
      if (branch != nullptr) {
        for (int64_t c = 0; c < cols; ++c) sum[row * cols + c] = v[c] + H::load(branch[row * cols + c]);
        v = sum + row * cols;
      }
      double total = 0.0, squares = 0.0;  // (the row's; sum is the residual sum's output)
      for (int64_t c = 0; c < cols; ++c) total += v[c];
      const double m = total / cols;
      for (int64_t c = 0; c < cols; ++c) squares += (v[c] - m) * (v[c] - m);
      const double r = 1.0 / sqrt(squares / cols + epsilon);
      for (int64_t c = 0; c < cols; ++c) {
        const float value = static_cast<float>((v[c] - m) * r * gamma[c] + beta[c]);
        y[row * cols + c] = H::store(value);
        if (y32 != nullptr) y32[row * cols + c] = value;
      }
      mean[row] = static_cast<float>(m);
      rstd[row] = static_cast<float>(r);
    }
  });
}

// a softmax's gradient over rows of `cols` values, the row's sum in float64
template <typename T>
void softmax_grad_cpu(const void* dy_, const void* y_, void* dx_, int64_t rows, int64_t cols) {
  using S = typename T::Storage;
  const S *dy = static_cast<const S*>(dy_), *y = static_cast<const S*>(y_);
  S* dx = static_cast<S*>(dx_);
  parallel(rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const S *d = dy + row * cols, *v = y + row * cols;
      double sum = 0.0;
      for (int64_t c = 0; c < cols; ++c) sum += static_cast<double>(T::load(d[c])) * T::load(v[c]);
      S* out = dx + row * cols;
      for (int64_t c = 0; c < cols; ++c)
        out[c] = T::store(static_cast<float>(T::load(v[c]) * (T::load(d[c]) - sum)));
    }
  });
}

// a safe softmax over rows of `cols` values: exp(x - max) / sum, zeros for a row of only -inf (a NaN anywhere in
// a row makes the row NaN, as torch's softmax does); with a bias (nullptr: none), of x + bias broadcast
// (RowBroadcast) and rounded to the dtype, as an Add node before it gives
template <typename T>
void safe_softmax_cpu(const void* x_, const void* bias_, const RowBroadcast& broadcast, void* y_, int64_t rows,
                      int64_t cols) {
  using S = typename T::Storage;
  const S* x = static_cast<const S*>(x_);
  const S* bias = static_cast<const S*>(bias_);
  S* y = static_cast<S*>(y_);
  parallel(rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> row_values(static_cast<size_t>(cols));
    for (int64_t row = begin; row < end; ++row) {
      const S* v = x + row * cols;
      const S* b = bias == nullptr ? nullptr : bias + broadcast.row_offset(row);
      S* out = y + row * cols;
      double top = -INFINITY;
      bool masked = true;
      for (int64_t c = 0; c < cols; ++c) {
        const float value =
            b == nullptr ? T::load(v[c]) : T::load(T::store(T::load(v[c]) + T::load(b[c * broadcast.col_stride])));
        row_values[c] = value;
        top = value > top ? value : top;
        masked = masked && value == -INFINITY;
      }
      if (masked) {
        for (int64_t c = 0; c < cols; ++c) out[c] = T::store(0.0f);
        continue;
      }
      double sum = 0.0;
      for (int64_t c = 0; c < cols; ++c) sum += exp(row_values[c] - top);
      for (int64_t c = 0; c < cols; ++c) out[c] = T::store(static_cast<float>(exp(row_values[c] - top) / sum));
    }
  });
}

// cross-entropy of rows of `classes` scores `cols` apart (a padded product's rows: the rest are not scores): lse
// by a max and a float64 sum of exp; the row's loss lse - x[target]
template <typename T>
void cross_entropy_cpu(const void* x_, const int64_t* target, float* losses, float* lse, int64_t rows, int64_t cols,
                       int64_t classes, int64_t ignore_index) {
  using S = typename T::Storage;
  const S* x = static_cast<const S*>(x_);
  parallel(rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(classes, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const S* v = x + row * cols;
      double top = -INFINITY, sum = 0.0;
      bool nan = false;
      for (int64_t c = 0; c < classes; ++c) {
        const double value = T::load(v[c]);
        nan = nan || value != value;
        top = value > top ? value : top;
      }
      for (int64_t c = 0; c < classes; ++c) sum += exp(T::load(v[c]) - top);
      const double row_lse = nan ? NAN : top == -INFINITY ? -INFINITY : top + log(sum);  // (torch's logsumexp)
      lse[row] = static_cast<float>(row_lse);
      const int64_t t = target[row];
      losses[row] = t == ignore_index ? 0.0f
                    : (t >= 0 && t < classes ? static_cast<float>(row_lse - T::load(v[t])) : NAN);
    }
  });
}

// dx of rows `cols` wide: the gradient in the first `classes`, zeros in the rest
template <typename T>
void cross_entropy_grad_cpu(const float* grad, const void* x_, const int64_t* target, const float* lse, void* dx_,
                            int64_t rows, int64_t cols, int64_t classes, int64_t ignore_index) {
  using S = typename T::Storage;
  const S* x = static_cast<const S*>(x_);
  S* dx = static_cast<S*>(dx_);
  parallel(rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(cols, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = target[row];
      const double g = t == ignore_index ? 0.0 : grad[row];
      const S* v = x + row * cols;
      S* out = dx + row * cols;
      for (int64_t c = 0; c < classes; ++c) {
        const double p = g == 0.0 ? 0.0 : exp(T::load(v[c]) - static_cast<double>(lse[row])) * g;
        out[c] = T::store(static_cast<float>(c == t ? p - g : p));
      }
      for (int64_t c = classes; c < cols; ++c) out[c] = T::store(0.0f);
    }
  });
}

// sum + xs[0] + ... + xs[count - 1], each widened to float32, over n values (the first n of each: a padded
// product's leading rows), one float32 add an element and x, in order, as Casts then a chain of Adds compute it; sum
// in U (float32, or the xs' half dtype)
template <typename U, typename T>
void add_half_cpu(const void* sum_, const void* const* xs, int count, float* out, int64_t n) {
  const typename U::Storage* sum = static_cast<const typename U::Storage*>(sum_);
  parallel(n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = U::load(sum[i]);
    for (int k = 0; k < count; ++k) {
      const typename T::Storage* x = static_cast<const typename T::Storage*>(xs[k]);
      for (int64_t i = begin; i < end; ++i) out[i] += T::load(x[i]);
    }
  });
}

// CastsToFloat16 and CastsToBFloat16: each copy's x rounded to T, zeros past its values; the copies' elements, one
// run after another, shared among the cores as one range
template <typename T>
void half_copies_cpu(const HalfCopy* copies, int count) {
  std::vector<int64_t> starts(count + 1, 0);  // copy k's elements in the whole range: [starts[k], starts[k + 1])
  for (int k = 0; k < count; ++k) starts[k + 1] = starts[k] + copies[k].padded;
  parallel(starts[count], kGrain, [&](int64_t begin, int64_t end) {
    int k = static_cast<int>(std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin()) - 1;
    for (int64_t at = begin; at < end; ++k) {
      const HalfCopy& copy = copies[k];
      const int64_t first = at - starts[k], last = std::min(end, starts[k + 1]) - starts[k];
      typename T::Storage* y = static_cast<typename T::Storage*>(copy.y);
      for (int64_t i = first; i < last; ++i) y[i] = T::store(i < copy.n ? copy.x[i] : 0.0f);
      at = starts[k] + last;
    }
  });
}

// SeededDropout (philox.h): y = x * scale where element i's draw under `seed` for node `stream` is below
// `threshold`, x * 0 elsewhere (a dropped NaN stays NaN, as in torch); mask[i] whether it was kept. Each share of the
// cores draws whole blocks of four elements, as a GPU thread does: the values do not depend on the split
template <typename T>
void seeded_dropout_cpu(const void* x, void* y, bool* mask, int64_t n, uint64_t seed, uint32_t stream,
                        uint32_t threshold, float scale) {
  const auto* xs = static_cast<const typename T::Storage*>(x);
  auto* ys = static_cast<typename T::Storage*>(y);
  parallel((n + 3) / 4, kGrain / 4, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group) {
      uint32_t draws[4];
      dropout_draws(seed, stream, static_cast<uint64_t>(group), draws);
      for (int64_t k = 0, i = group * 4; k < 4 && i < n; ++k, ++i) {
        mask[i] = draws[k] < threshold;
        ys[i] = T::store(T::load(xs[i]) * (mask[i] ? scale : 0.0f));
      }
    }
  });
}

}  // namespace ort_trainer_kernels

// computeRopeParams (declared in pagedkv/qkv_write.h): the user-facing RopeConfig -> the kernel's tables of
// inverse frequencies. The kernels never see a formula, only RopeParams::invFreq (and longInvFreq), mscale and
// longAboveKVLen, so a new scaling is a new case here and nothing else.
//
// Inverse frequencies are computed in double and rounded once to float: invFreq[i] = theta^(-2i/R), then
//   linear:   / factor
//   llama3:   Llama-3's wavelength rule (as in Hugging Face transformers' `_compute_llama3_parameters`):
//             wavelength = 2 pi / f; f unchanged below original_max_positions / high_freq_factor, f / factor
//             above original_max_positions / low_freq_factor, smooth interpolation in between.
//   yarn:     transformers' `_compute_yarn_parameters`: dims d(b) = R ln(N / (2 pi b)) / (2 ln theta) for
//             b = beta_fast (low) and beta_slow (high), N = original_max_positions, rounded outward when truncate,
//             clamped to [0, R - 1]; ramp(i) = clamp((i - low) / (high - low), 0, 1);
//             f = f * (1 - ramp) + (f / factor) * ramp. mscale = the attention factor.
//   longrope: transformers' `_compute_longrope_parameters`: f / short_factors[i] (invFreq) and
//             f / long_factors[i] (longInvFreq, from kv length > original_max_positions on). mscale = the
//             attention factor.
// On an invalid config it returns false, leaves `out` untouched and records the reason (field and value)
// for lastErrorMessage().
#include <algorithm>
#include <cmath>
#include <string>

#include "launch_common.h"
#include "pagedkv/qkv_write.h"

namespace pagedkv {
namespace {

bool fail(std::string field, std::string const& value, std::string const& expected) {
    invalidArgument(std::move(field) + "=" + value + ": expected " + expected);
    return false;
}

bool finitePositive(double v) { return std::isfinite(v) && v > 0.0; }

}  // namespace

namespace {

bool finiteNonNegative(double v) { return std::isfinite(v) && v >= 0.0; }

// Hugging Face's find_correction_dim: the dim whose frequency turns `rotations` times over `positions`.
double yarnCorrectionDim(double rotations, int32_t rotary, double theta, double positions) {
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    return rotary * std::log(positions / (rotations * kTwoPi)) / (2.0 * std::log(theta));
}

// The attention factor (mscale): the configured one, or Hugging Face's default for the scaling.
double attentionFactor(RopeConfig const& cfg) {
    if (cfg.attentionFactor > 0.f) return cfg.attentionFactor;
    double const factor = cfg.factor;
    if (factor <= 1.0) return 1.0;
    if (cfg.scaling == RopeScaling::kYarn) return 0.1 * std::log(factor) + 1.0;
    return std::sqrt(1.0 + std::log(factor) / std::log(static_cast<double>(cfg.originalMaxPositions)));  // longrope
}

bool validateScaling(RopeConfig const& cfg, int32_t rotary) {
    switch (cfg.scaling) {
        case RopeScaling::kNone: return true;
        case RopeScaling::kLinear:
        case RopeScaling::kLlama3:
        case RopeScaling::kYarn:
        case RopeScaling::kLongRope: break;
        default:
            return fail("rope_scaling", std::to_string(static_cast<int32_t>(cfg.scaling)),
                        "0 (none), 1 (linear), 2 (llama3), 3 (yarn) or 4 (longrope)");
    }
    if (!finitePositive(cfg.factor)) return fail("rope_factor", std::to_string(cfg.factor), "finite and > 0");
    if (cfg.scaling == RopeScaling::kLinear) return true;
    if (cfg.originalMaxPositions <= 0)
        return fail("rope_original_max_positions", std::to_string(cfg.originalMaxPositions), "> 0");
    if (cfg.scaling == RopeScaling::kLlama3) {
        if (!finitePositive(cfg.lowFreqFactor))
            return fail("rope_low_freq_factor", std::to_string(cfg.lowFreqFactor), "finite and > 0");
        if (!(std::isfinite(cfg.highFreqFactor) && cfg.highFreqFactor > cfg.lowFreqFactor))
            return fail("rope_high_freq_factor", std::to_string(cfg.highFreqFactor), "finite and > rope_low_freq_factor");
        return true;
    }
    if (!finiteNonNegative(cfg.attentionFactor))
        return fail("rope_attention_factor", std::to_string(cfg.attentionFactor), "finite and >= 0 (0: the default)");
    if (!std::isfinite(attentionFactor(cfg)))
        return fail("rope_attention_factor", "0", "a finite default: rope_original_max_positions=" +
                    std::to_string(cfg.originalMaxPositions) + " must be > 1 with rope_factor > 1");
    if (cfg.scaling == RopeScaling::kYarn) {
        if (!finitePositive(cfg.betaFast)) return fail("rope_beta_fast", std::to_string(cfg.betaFast), "finite and > 0");
        if (!finitePositive(cfg.betaSlow)) return fail("rope_beta_slow", std::to_string(cfg.betaSlow), "finite and > 0");
        if (cfg.truncate != 0 && cfg.truncate != 1)
            return fail("rope_truncate", std::to_string(cfg.truncate), "0 or 1");
        return true;
    }
    if (cfg.numFactors != rotary / 2)  // longrope
        return fail("rope_short_factors", std::to_string(cfg.numFactors) + " values",
                    "rope_rotary_dim / 2 = " + std::to_string(rotary / 2) + " values (and as many rope_long_factors)");
    for (int32_t i = 0; i < cfg.numFactors; ++i) {
        if (!finitePositive(cfg.shortFactors[i]))
            return fail("rope_short_factors[" + std::to_string(i) + "]", std::to_string(cfg.shortFactors[i]),
                        "finite and > 0");
        if (!finitePositive(cfg.longFactors[i]))
            return fail("rope_long_factors[" + std::to_string(i) + "]", std::to_string(cfg.longFactors[i]),
                        "finite and > 0");
    }
    return true;
}

}  // namespace

bool computeRopeParams(RopeConfig const& cfg, int32_t headDim, RopeParams& out) {
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    RopeParams r{};
    r.style = cfg.style;
    r.mscale = 1.f;
    r.longAboveKVLen = 0;
    if (cfg.style != RopeStyle::kNone && cfg.style != RopeStyle::kNeox && cfg.style != RopeStyle::kGptj)
        return fail("rope_style", std::to_string(static_cast<int32_t>(cfg.style)), "0 (none), 1 (neox) or 2 (gptj)");
    if (headDim <= 0) return fail("head_dim", std::to_string(headDim), "> 0");
    if (cfg.style == RopeStyle::kNone) {
        r.rotaryDim = 0;
        out = r;
        return true;
    }
    int32_t const rotary = cfg.rotaryDim == 0 ? headDim : cfg.rotaryDim;
    if (rotary < 2 || rotary > headDim || rotary % 2 != 0 || rotary / 2 > kMaxRotaryPairs)
        return fail("rope_rotary_dim", std::to_string(cfg.rotaryDim),
                    "0 (= head_dim) or even and in [2, head_dim=" + std::to_string(headDim) + "]");
    if (!finitePositive(cfg.theta)) return fail("rope_theta", std::to_string(cfg.theta), "finite and > 0");
    if (!validateScaling(cfg, rotary)) return false;
    r.rotaryDim = rotary;
    double const theta = cfg.theta;
    double yarnLow = 0.0;
    double yarnHigh = 0.0;
    if (cfg.scaling == RopeScaling::kYarn) {
        yarnLow = yarnCorrectionDim(cfg.betaFast, rotary, theta, cfg.originalMaxPositions);
        yarnHigh = yarnCorrectionDim(cfg.betaSlow, rotary, theta, cfg.originalMaxPositions);
        if (cfg.truncate != 0) {
            yarnLow = std::floor(yarnLow);
            yarnHigh = std::ceil(yarnHigh);
        }
        yarnLow = std::max(yarnLow, 0.0);
        yarnHigh = std::min(yarnHigh, static_cast<double>(rotary - 1));
        if (yarnLow == yarnHigh) yarnHigh += 0.001;  // as Hugging Face: no zero-width ramp
    }
    for (int32_t i = 0; i < rotary / 2; ++i) {
        double f = std::pow(theta, -2.0 * i / rotary);
        double longF = 0.0;
        if (cfg.scaling == RopeScaling::kLinear) {
            f /= cfg.factor;
        } else if (cfg.scaling == RopeScaling::kLlama3) {
            double const wavelength = kTwoPi / f;
            double const highFreqWavelength = cfg.originalMaxPositions / static_cast<double>(cfg.highFreqFactor);
            double const lowFreqWavelength = cfg.originalMaxPositions / static_cast<double>(cfg.lowFreqFactor);
            if (wavelength > lowFreqWavelength) {
                f /= cfg.factor;  // long wavelengths: interpolate fully
            } else if (wavelength >= highFreqWavelength) {
                double const smooth = (cfg.originalMaxPositions / wavelength - cfg.lowFreqFactor) /
                                      (static_cast<double>(cfg.highFreqFactor) - cfg.lowFreqFactor);
                f = (1.0 - smooth) * f / cfg.factor + smooth * f;
            }  // short wavelengths: unchanged
        } else if (cfg.scaling == RopeScaling::kYarn) {
            double const ramp = std::min(std::max((i - yarnLow) / (yarnHigh - yarnLow), 0.0), 1.0);
            f = f * (1.0 - ramp) + f / cfg.factor * ramp;  // ramp 0: extrapolated (unchanged), 1: interpolated
        } else if (cfg.scaling == RopeScaling::kLongRope) {
            longF = f / cfg.longFactors[i];
            f /= cfg.shortFactors[i];
        }
        r.invFreq[i] = static_cast<float>(f);
        r.longInvFreq[i] = static_cast<float>(longF);
    }
    if (cfg.scaling == RopeScaling::kYarn || cfg.scaling == RopeScaling::kLongRope)
        r.mscale = static_cast<float>(attentionFactor(cfg));
    if (cfg.scaling == RopeScaling::kLongRope) r.longAboveKVLen = cfg.originalMaxPositions;
    out = r;
    return true;
}

}  // namespace pagedkv

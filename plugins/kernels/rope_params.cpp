// computeRopeParams (declared in pagedkv/qkv_write.h): the user-facing RopeConfig -> the kernel's table of
// inverse frequencies. The kernels never see a formula, only RopeParams::invFreq and mscale, so a new
// scaling (YaRN, LongRoPE) is a new case here and nothing else.
//
// Inverse frequencies are computed in double and rounded once to float: invFreq[i] = theta^(-2i/R), then
//   linear: / factor
//   llama3: Llama-3's wavelength rule (as in Hugging Face transformers' `_compute_llama3_parameters`):
//           wavelength = 2 pi / f; f unchanged below original_max_positions / high_freq_factor, f / factor
//           above original_max_positions / low_freq_factor, smooth interpolation in between.
// On an invalid config it returns false, leaves `out` untouched and records the reason (field and value)
// for lastErrorMessage().
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

bool computeRopeParams(RopeConfig const& cfg, int32_t headDim, RopeParams& out) {
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    RopeParams r{};
    r.style = cfg.style;
    r.mscale = 1.f;
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
    switch (cfg.scaling) {
        case RopeScaling::kNone: break;
        case RopeScaling::kLinear:
            if (!finitePositive(cfg.factor)) return fail("rope_factor", std::to_string(cfg.factor), "finite and > 0");
            break;
        case RopeScaling::kLlama3:
            if (!finitePositive(cfg.factor)) return fail("rope_factor", std::to_string(cfg.factor), "finite and > 0");
            if (!finitePositive(cfg.lowFreqFactor))
                return fail("rope_low_freq_factor", std::to_string(cfg.lowFreqFactor), "finite and > 0");
            if (!(std::isfinite(cfg.highFreqFactor) && cfg.highFreqFactor > cfg.lowFreqFactor))
                return fail("rope_high_freq_factor", std::to_string(cfg.highFreqFactor),
                            "finite and > rope_low_freq_factor");
            if (cfg.originalMaxPositions <= 0)
                return fail("rope_original_max_positions", std::to_string(cfg.originalMaxPositions), "> 0");
            break;
        default:
            return fail("rope_scaling", std::to_string(static_cast<int32_t>(cfg.scaling)),
                        "0 (none), 1 (linear) or 2 (llama3)");
    }
    r.rotaryDim = rotary;
    for (int32_t i = 0; i < rotary / 2; ++i) {
        double f = std::pow(static_cast<double>(cfg.theta), -2.0 * i / rotary);
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
        }
        r.invFreq[i] = static_cast<float>(f);
    }
    out = r;
    return true;
}

}  // namespace pagedkv

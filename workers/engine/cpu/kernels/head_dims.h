// The head sizes the kernels' specialised paths are compiled for, and the one switch over them.
#pragma once
#include <cstdint>
#include <type_traits>

namespace mmfusion {

// fn(std::integral_constant<int, D>{}) for D = d when d is 64, 128 or 256, and true; false for
// other sizes (the caller's generic path serves them)
template <typename F>
bool with_head_dim(int64_t d, F&& fn) {
  switch (d) {
    case 64: fn(std::integral_constant<int, 64>{}); return true;
    case 128: fn(std::integral_constant<int, 128>{}); return true;
    case 256: fn(std::integral_constant<int, 256>{}); return true;
    default: return false;
  }
}

}  // namespace mmfusion

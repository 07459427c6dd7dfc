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

// with_head_dim, and for a path that takes any multiple of 8 (the float32 decode) the smaller and
// odd sizes of small models too: 16 and 32 (tiny test models), 80 and 96
template <typename F>
bool with_any8_head_dim(int64_t d, F&& fn) {
  switch (d) {
    case 16: fn(std::integral_constant<int, 16>{}); return true;
    case 32: fn(std::integral_constant<int, 32>{}); return true;
    case 80: fn(std::integral_constant<int, 80>{}); return true;
    case 96: fn(std::integral_constant<int, 96>{}); return true;
    default: return with_head_dim(d, fn);
  }
}

}  // namespace mmfusion

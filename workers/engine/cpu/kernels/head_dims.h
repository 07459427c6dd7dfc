// The head sizes the kernels' specialised paths are compiled for, and the one switch over them.
#pragma once
#include <cstdint>
#include <type_traits>

namespace mmfusion {

// fn(std::integral_constant<int, D>{}) for the D of Ds equal to d, and true; false where none is
// (the caller's generic path serves that size)
template <int... Ds, typename F>
bool with_one_of(int64_t d, F&& fn) {
  return ((d == Ds && (fn(std::integral_constant<int, Ds>{}), true)) || ...);
}

// the sizes every specialised path takes
template <typename F>
bool with_head_dim(int64_t d, F&& fn) {
  return with_one_of<64, 128, 256>(d, fn);
}

// those, and for a path that takes any multiple of 8 (the float32 decode) the smaller and odd
// sizes of small models too: 16 and 32 (tiny test models), 80 and 96
template <typename F>
bool with_any8_head_dim(int64_t d, F&& fn) {
  return with_one_of<16, 32, 64, 80, 96, 128, 256>(d, fn);
}

}  // namespace mmfusion

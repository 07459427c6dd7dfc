// The parts of ATen the kernels use. <torch/extension.h> pulls in all of libtorch's C++ API and
// pybind11: about 45 s of compile per file on a 2-core machine, against a few seconds for these.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

namespace torch {
using at::Tensor;
using at::empty;
using at::empty_like;
using at::kLong;
}  // namespace torch

// bindings/torch/csrc/layer.cpp: the host layers of epx_torch (layer.hpp): torch_layer
// (CPU tensors, exec::openmp) and emulated_torch_layer (the device path on the CPU).
#include "layer_impl.hpp"

namespace epx_torch {

template class basic_torch_layer<epx::exec::openmp, torch_communicator>;
template class basic_torch_layer<epx::exec::emulated_device, torch_device_communicator<epx::exec::emulated_device>>;

}  // namespace epx_torch

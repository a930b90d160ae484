#include "kernel_module.h"

#include <cstdint>
#include <string>

namespace jax_kda {

const char* ArchName(Arch arch) {
  switch (arch) {
    case Arch::kSm90a:
      return "sm_90a";
    case Arch::kSm100a:
      return "sm_100a";
  }
  return "unknown";
}

std::optional<Arch> ArchForComputeCapability(int major, int minor) {
  if (major == 9 && minor == 0) return Arch::kSm90a;
  if (major == 10 && minor == 0) return Arch::kSm100a;
  return std::nullopt;
}

std::string CudaErrorText(cudaError_t error) {
  return std::string(cudaGetErrorName(error)) + " (" + cudaGetErrorString(error) + ")";
}

const std::string& KernelModules::Load() {
  std::call_once(once_, [this] { load_error_ = LoadAll(); });
  return load_error_;
}

std::string KernelModules::LoadAll() {
  int device_count = 0;
  if (cudaError_t error = cudaGetDeviceCount(&device_count); error != cudaSuccess) {
    return "jax_kda: cudaGetDeviceCount failed: " + CudaErrorText(error);
  }
  compute_capabilities_.resize(device_count);
  multiprocessor_counts_.resize(device_count);
  for (int device = 0; device < device_count; ++device) {
    auto& [major, minor] = compute_capabilities_[device];
    cudaError_t error = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (error == cudaSuccess) {
      error = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    }
    if (error == cudaSuccess) {
      error = cudaDeviceGetAttribute(&multiprocessor_counts_[device], cudaDevAttrMultiProcessorCount, device);
    }
    if (error != cudaSuccess) {
      return "jax_kda: reading the attributes of CUDA device " + std::to_string(device) +
             " failed: " + CudaErrorText(error);
    }
  }

  for (const ExportedObject& object : objects_) {
    bool library_loaded = false;
    for (int device = 0; device < device_count; ++device) {
      const auto [major, minor] = compute_capabilities_[device];
      if (ArchForComputeCapability(major, minor) != object.arch) continue;

      // The argument packing of the exported entry points, as the generated header spells it:
      // init(&library_ptr, &ret) and load_to_device(&library_ptr, &device, &ret).
      cudaLibrary_t* library_ptr = object.library;
      cudaError_t ret = cudaSuccess;
      if (!library_loaded) {
        void* init_args[] = {&library_ptr, &ret};
        object.init(init_args);
        if (ret != cudaSuccess) {
          return std::string("jax_kda: loading the kernel object ") + object.name +
                 " failed: " + CudaErrorText(ret);
        }
        library_loaded = true;
      }
      int32_t device_id = device;
      void* load_args[] = {&library_ptr, &device_id, &ret};
      object.load_to_device(load_args);
      if (ret != cudaSuccess) {
        return std::string("jax_kda: loading the kernel object ") + object.name + " onto CUDA device " +
               std::to_string(device) + " (compute capability " + std::to_string(major) + "." +
               std::to_string(minor) + ") failed: " + CudaErrorText(ret);
      }
    }
  }
  return {};
}

std::optional<Arch> KernelModules::ArchOfDevice(int device, std::string* error) const {
  if (device < 0 || device >= static_cast<int>(compute_capabilities_.size())) {
    *error = "jax_kda: CUDA device " + std::to_string(device) + " is not among the " +
             std::to_string(compute_capabilities_.size()) + " devices seen when the kernels were loaded";
    return std::nullopt;
  }
  const auto [major, minor] = compute_capabilities_[device];
  std::optional<Arch> arch = ArchForComputeCapability(major, minor);
  if (!arch) {
    *error = "jax_kda: CUDA device " + std::to_string(device) + " has compute capability " +
             std::to_string(major) + "." + std::to_string(minor) +
             "; the jax_kda kernels run on 9.0 (sm_90a) and 10.0 (sm_100a) only. Use backend=\"xla\" on "
             "this device.";
  }
  return arch;
}

int KernelModules::MultiprocessorCount(int device) const {
  if (device < 0 || device >= static_cast<int>(multiprocessor_counts_.size())) return 0;
  return multiprocessor_counts_[device];
}

}  // namespace jax_kda

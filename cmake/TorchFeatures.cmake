# What the LibTorch found by find_package(Torch) offers, asked once here so
# that the sources test macros, never the library by trial:
#   LOCKSTEP_GLOO_INCLUDE_DIR  the Gloo headers ProcessGroupGloo.hpp needs
#   LOCKSTEP_TORCH_HAS_CUDA    a CUDA build, with NCCL
#   LOCKSTEP_TORCH_HAS_LIBUV   TCPStore's libuv server is linked in
# and lockstep_warnings(TARGET), the warnings lockstep's own code builds with.

# Debian's libtorch-dev leaves the Gloo headers to libgloo-dev; the
# pytorch.org zips and the pip wheel ship none (pytorch#91693). Say so here,
# not as a compile error deep inside c10d.
find_path(LOCKSTEP_GLOO_INCLUDE_DIR gloo/config.h
  HINTS ${TORCH_INCLUDE_DIRS}
  DOC "Where the Gloo headers of the commit your LibTorch pins are: one folder, or a Gloo checkout and its CMake build folder (which holds the generated gloo/config.h)")
set(gloo_config_found OFF)
set(gloo_sources_found OFF)
foreach(folder IN LISTS LOCKSTEP_GLOO_INCLUDE_DIR)
  if(EXISTS ${folder}/gloo/config.h)
    set(gloo_config_found ON)
  endif()
  if(EXISTS ${folder}/gloo/allreduce.h)
    set(gloo_sources_found ON)
  endif()
endforeach()
if(NOT gloo_config_found OR NOT gloo_sources_found)
  if(LOCKSTEP_GLOO_INCLUDE_DIR)
    set(gloo_where "in LOCKSTEP_GLOO_INCLUDE_DIR=${LOCKSTEP_GLOO_INCLUDE_DIR}")
  else()
    set(gloo_where "beside LibTorch (${TORCH_INCLUDE_DIRS}) or in the system")
  endif()
  message(FATAL_ERROR
    "lockstep needs the Gloo headers (gloo/config.h and the rest of gloo/), "
    "which c10d's ProcessGroupGloo.hpp includes, and found none ${gloo_where}.\n"
    "On Debian: apt-get install libgloo-dev.\n"
    "With a pytorch.org LibTorch or the pip wheel's (they ship none, "
    "pytorch#91693): clone Gloo at the commit your PyTorch release pins "
    "(git ls-tree <release tag> third_party/gloo in a PyTorch checkout), run "
    "cmake -S gloo -B gloo/build once so that gloo/build/gloo/config.h is "
    "generated, and pass "
    "-DLOCKSTEP_GLOO_INCLUDE_DIR=\"/path/gloo;/path/gloo/build\". "
    "See docs/guide.md, 'Other LibTorch distributions'.")
endif()

if(TORCH_CUDA_LIBRARIES)
  set(LOCKSTEP_TORCH_HAS_CUDA ON)
else()
  set(LOCKSTEP_TORCH_HAS_CUDA OFF)
endif()

# LibTorch 2.4 on made libuv TCPStore's default server even where it was
# built without libuv (Debian 13), where the default then fails. Whether
# libtorch_cpu links libuv tells: a LibTorch that has it built in
# statically reads as without, and gets the classic server, which every
# version has.
set(LOCKSTEP_TORCH_HAS_LIBUV OFF)
find_library(LOCKSTEP_TORCH_CPU_LIBRARY torch_cpu HINTS ${TORCH_INSTALL_PREFIX}/lib)
mark_as_advanced(LOCKSTEP_TORCH_CPU_LIBRARY)
if(LOCKSTEP_TORCH_CPU_LIBRARY AND CMAKE_OBJDUMP)
  execute_process(COMMAND ${CMAKE_OBJDUMP} -p ${LOCKSTEP_TORCH_CPU_LIBRARY}
    OUTPUT_VARIABLE torch_cpu_headers ERROR_QUIET)
  if(torch_cpu_headers MATCHES "NEEDED +libuv")
    set(LOCKSTEP_TORCH_HAS_LIBUV ON)
  endif()
endif()
message(STATUS "lockstep: LibTorch ${Torch_VERSION}, Gloo headers in "
  "${LOCKSTEP_GLOO_INCLUDE_DIR}, CUDA ${LOCKSTEP_TORCH_HAS_CUDA}, "
  "libuv TCPStore ${LOCKSTEP_TORCH_HAS_LIBUV}")

function(lockstep_warnings target)
  target_compile_options(${target} PRIVATE -Wall -Wextra)
  if(LOCKSTEP_WARNINGS_AS_ERRORS)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
endfunction()

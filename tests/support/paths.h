#pragma once

// Where the source tree is, and the programs that the tests run. They come
// from one small unit compiled with the paths (paths.cpp) rather than from
// definitions on every test unit's command line, so that those commands do
// not name the checkout: ccache then serves a fresh clone (CI's) what
// another checkout compiled.

namespace lockstep::testing {

const char* source_dir();
const char* lockstep_run_binary();
const char* mnist_train_binary();
const char* mnist_elastic_binary();
const char* elastic_float64_binary();
const char* diloco_float64_binary();
const char* groups_float64_binary();
const char* hello_binary();

} // namespace lockstep::testing

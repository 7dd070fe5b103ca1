#include "support/paths.h"

namespace lockstep::testing {

const char* source_dir() {
  return LOCKSTEP_SOURCE_DIR;
}
const char* lockstep_run_binary() {
  return LOCKSTEP_RUN_BINARY;
}
const char* mnist_train_binary() {
  return MNIST_TRAIN_BINARY;
}
const char* mnist_elastic_binary() {
  return MNIST_ELASTIC_BINARY;
}
const char* elastic_float64_binary() {
  return ELASTIC_FLOAT64_BINARY;
}
const char* diloco_float64_binary() {
  return DILOCO_FLOAT64_BINARY;
}
const char* groups_float64_binary() {
  return GROUPS_FLOAT64_BINARY;
}
const char* hello_binary() {
  return HELLO_BINARY;
}

} // namespace lockstep::testing

// The OpenMPI peer of bench/allreduce.cpp: the same loop through
// MPI_Allreduce (float32 sum, in place), which OpenMPI runs over its own
// shared-memory transport between the ranks of one host. Built when CMake
// finds MPI (Debian libopenmpi-dev; bench/run-allreduce installs it).

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  for (long long bytes = 4 << 10; bytes <= 64 << 20; bytes *= 4) {
    std::vector<float> buffer(static_cast<size_t>(bytes / 4), 1.0f);
    int count = static_cast<int>(buffer.size());
    int iterations = static_cast<int>(std::clamp<long long>((256 << 20) / bytes, 10, 200));
    for (int i = 0; i < 3; ++i) {
      MPI_Allreduce(MPI_IN_PLACE, buffer.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    }
    std::vector<double> micros;
    for (int i = 0; i < iterations; ++i) {
      std::fill(buffer.begin(), buffer.end(), 1.0f);
      MPI_Barrier(MPI_COMM_WORLD);
      auto start = std::chrono::steady_clock::now();
      MPI_Allreduce(MPI_IN_PLACE, buffer.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      micros.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
              .count());
    }
    std::nth_element(micros.begin(), micros.begin() + micros.size() / 2, micros.end());
    double median = micros[micros.size() / 2];
    double busbw = bytes * 2.0 * (size - 1) / size / (median * 1e-6) / 1e9;
    if (rank == 0) {
      std::printf("openmpi,%lld,%d,%.1f,%.3f\n", bytes, iterations, median, busbw);
      std::fflush(stdout);
    }
  }
  MPI_Finalize();
  return 0;
}

// lockstep-run: the launcher. See options.cpp for the command line.

#include <iostream>

#include "options.h"
#include "supervisor.h"

int main(int argc, char** argv) {
  using namespace lockstep::run;
  RunOptions options;
  try {
    options = parse_options(argc, argv);
  } catch (const UsageError& e) {
    std::cerr << "lockstep-run: " << e.what() << "\n\n" << kUsage;
    return 2;
  }
  if (options.help) {
    std::cout << kUsage;
    return 0;
  }
  try {
    install_signal_forwarding();
    int port = options.master_port != 0 ? options.master_port : pick_free_port();
    LauncherStore store(options, port);
    for (int attempt = 0;; ++attempt) {
      auto result = run_attempt(options, attempt, port, store);
      if (result.outcome == Outcome::Succeeded) {
        store.linger(std::chrono::seconds(10));
        return 0;
      }
      if (result.outcome == Outcome::Interrupted) {
        return 128 + result.signal;
      }
      if (attempt >= options.max_restarts || options.restart_rank) {
        std::cerr << "lockstep-run: the job failed"
                  << (options.max_restarts > 0 && !options.restart_rank
                          ? " after " + std::to_string(attempt) + " restart(s)"
                          : "")
                  << std::endl;
        return 1;
      }
      std::cerr << "lockstep-run: restarting every rank (restart " << attempt + 1
                << " of " << options.max_restarts << ")" << std::endl;
    }
  } catch (const std::exception& e) {
    std::cerr << "lockstep-run: " << e.what() << std::endl;
    return 1;
  }
}

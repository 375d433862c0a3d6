// `partrain parity A B`: runs two partrain command lines (or takes two metrics files) and says
// whether their losses agree step by step within a tolerance, and where they part
// (docs/observability.md). Exit status: 0 within tolerance, 1 diverged, 2 a usage error or
// inputs that cannot be compared, 3 a command that failed.
#pragma once

#include <string>
#include <vector>

namespace partrain::app {

/// Splits a command line into words as a POSIX shell would, quotes and backslashes included
/// (no variables, globs or redirections). Returns false with `error` set on an unclosed quote.
bool split_words(const std::string& line, std::vector<std::string>& words, std::string& error);

/// This partrain's own path (/proc/self/exe), to start it again; throws when it cannot be read.
std::string self_path();

/// `partrain parity ...`; argv[first] is the first word after `parity`. Returns the exit status.
int run_parity(int argc, char** argv, int first);

}  // namespace partrain::app

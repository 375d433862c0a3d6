// Opening, reading and writing files the way every part of partrain must: only regular files,
// sizes bounded before anything is allocated, names from a safe alphabet, and writes that land
// whole (a temporary made exclusively, never through a planted link, then renamed); and the
// folder operations built on the same rules (listing, making, removing, renaming without replacing).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace partrain::util {

/// How open_regular treats a symbolic link at the path itself.
enum class Links {
  Follow,  ///< a link to a regular file is fine (a script, a data file the user points at)
  Refuse,  ///< the path must not be a link (files inside a checkpoint folder)
};

/// Opens `path` for reading and returns the descriptor. Refuses, with an error naming the path and
/// `what` ("checkpoint manifest", "script"), anything that is not a regular file: folders, FIFOs,
/// sockets, devices (/dev/zero), and links when `links` is Refuse. Never blocks on a FIFO.
int open_regular(const std::string& path, const std::string& what, Links links = Links::Follow);

/// Whether `path` names a regular file (not following a final link when `links` is Refuse).
bool is_regular(const std::string& path, Links links = Links::Follow);
/// Whether `path` names a folder (not a link to one).
bool is_plain_dir(const std::string& path);

/// The whole of a regular file, refused when it holds more than `max_bytes` (nothing larger is
/// allocated).
std::string read_regular(const std::string& path, const std::string& what, uint64_t max_bytes,
                         Links links = Links::Follow);

/// Whether `name` is a safe file or folder name: 1-128 characters from [A-Za-z0-9._-], not
/// starting with '.' or '-' (so never ".", "..", a hidden scratch name or an option).
bool safe_name(const std::string& name);

/// Creates `path`, which must not exist (a link planted there is not followed), with `bytes`,
/// flushed to disk; a file left part-written by an error is removed.
void write_new(const std::string& path, const std::string& bytes);

/// Writes `bytes` to `path` so that a reader sees the old file or the new one, never a part:
/// a temporary beside it, created with O_EXCL | O_NOFOLLOW (a link planted there is not
/// followed), flushed to disk, renamed over `path`, and the folder flushed. A `path` that exists
/// and is not a regular file (a device, a FIFO, a link, a folder) is refused, naming what it is.
void write_atomic(const std::string& path, const std::string& bytes);

/// Whether an output may be written at `path`: "" when nothing is there, or a regular file whose
/// first bytes (up to 64) `ours` recognizes as the kind about to be written (a report over a
/// report); else why not, naming the path and `kind` ("an HTML report"): a training script or a
/// metrics file given as the output by mistake is never replaced.
std::string may_replace(const std::string& path, const std::function<bool(const std::string&)>& ours,
                        const std::string& kind);

/// Flushes a file or folder to disk (best effort: errors are ignored).
void fsync_path(const std::string& path);

/// `dir`/`name`.
std::string join_path(const std::string& dir, const std::string& name);
/// Whether anything is at `path`: a file, a folder, or a link (wherever it points).
bool exists(const std::string& path);
/// The names in the folder `path` but "." and "..", sorted; none when it cannot be opened, and
/// then the errno in `*error` (0 otherwise) when `error` is given.
std::vector<std::string> list_dir(const std::string& path, int* error = nullptr);

/// Makes the folder `path` and any folder above it that is missing; refuses, naming it, a path
/// that is not a folder then.
void make_dirs(const std::string& path);
/// Removes a file, a link (never what it points to) or a folder and everything in it, as far as
/// it can (errors are ignored).
void remove_all(const std::string& path);
/// Renames `from` to `to`, never replacing what is at `to`.
void rename_new(const std::string& from, const std::string& to);
/// Swaps the folders `a` and `b` in one step, so that `b` is never missing (where the file system
/// cannot swap: three renames through `spare`, which is removed first).
void exchange(const std::string& a, const std::string& b, const std::string& spare);

/// Reads exactly `n` bytes at `offset` of an open file; false when the file ends first or a read
/// fails.
bool read_at(int fd, char* out, uint64_t n, uint64_t offset);
/// Creates `path` for writing, which must not exist (a link planted there is not followed), and
/// returns the descriptor.
int create_new(const std::string& path);
/// Writes all `n` bytes at `data` to `fd`; an error names `path` (the caller closes `fd`).
void write_all(int fd, const char* data, size_t n, const std::string& path);

}  // namespace partrain::util

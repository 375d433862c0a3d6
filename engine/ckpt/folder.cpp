// A checkpoint folder: its 'newest' file, its tag folders (valid or damaged) and what saves left
// beside them, and the choice of the tag a load without one takes.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/internal.hpp"
#include "engine/util/files.hpp"

namespace partrain::ckpt {

namespace internal {

namespace {

constexpr uint64_t kMaxNewestBytes = 1024;

NewestState read_newest(const std::string& dir) {
  NewestState s;
  std::string path = join_path(dir, "newest");
  if (!util::exists(path)) return s;
  s.present = true;
  std::string text;
  try {
    text = util::read_regular(path, "'newest' file", kMaxNewestBytes, util::Links::Refuse);
  } catch (const std::exception& e) {
    s.problem = util::message_of(e);
    return s;
  }
  auto bad = [&](const std::string& why) {
    s.problem = "'" + path + "' is damaged (" + why + ")";
    return s;
  };
  auto eol = text.find('\n');
  if (eol == std::string::npos) return bad(text.empty() ? "it is empty" : "it has no checksum line");
  std::string tag = text.substr(0, eol), rest = text.substr(eol + 1);
  if (rest.size() != 15 || rest.compare(0, 6, "crc32 ") != 0 || rest[14] != '\n') return bad("it has no checksum line");
  if (rest.substr(6, 8) != hex32(crc_of(tag.data(), tag.size()))) return bad("its checksum does not match");
  if (!util::safe_name(tag) || tag == "newest") return bad("it names '" + tag + "', which is not a tag");
  s.tag = tag;
  return s;
}

// Whether a folder without a manifest holds what a checkpoint holds (else it is not one).
bool looks_like_checkpoint(const std::string& path) {
  for (const auto& n : util::list_dir(path))
    if (n == "summary.txt" || (n.rfind("rank-", 0) == 0 && n.size() > 9 && n.compare(n.size() - 4, 4, ".bin") == 0))
      return true;
  return false;
}

}  // namespace

void write_newest(const std::string& dir, const std::string& tag) {
  util::write_atomic(join_path(dir, "newest"), tag + "\ncrc32 " + hex32(crc_of(tag.data(), tag.size())) + "\n");
}

TagState tag_state(const std::string& dir, const std::string& name) {
  TagState t;
  t.name = name;
  std::string path = join_path(dir, name);
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    t.problem = "'" + path + "' does not exist";
  } else if (S_ISLNK(st.st_mode)) {
    t.problem = "'" + path + "' is a symbolic link; a checkpoint tag must be a real folder";
  } else if (!S_ISDIR(st.st_mode)) {
    t.problem = "'" + path + "' is not a folder";
  } else {
    try {
      t.step = read_manifest(path).step;
      t.valid = true;
    } catch (const std::exception& e) {
      t.problem = util::message_of(e);
    }
  }
  return t;
}

Folder scan(const std::string& dir) {
  Folder f;
  int error = 0;
  const std::vector<std::string> names = util::list_dir(dir, &error);
  if (error) {
    TORCH_CHECK(error == ENOENT, "cannot read the checkpoint folder '", dir, "': ", std::strerror(error));
    return f;
  }
  f.exists = true;
  f.newest = read_newest(dir);
  for (const auto& n : names) {
    if (n == "newest") continue;
    std::string path = join_path(dir, n);
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) continue;
    if (n[0] == '.') {
      if (S_ISDIR(st.st_mode) && n.size() > 5 && n.compare(n.size() - 4, 4, ".tmp") == 0) f.scratch.push_back(n);
      continue;
    }
    if (!util::safe_name(n)) {
      if (n.find("~damaged") != std::string::npos) f.aside.push_back(n);
      continue;
    }
    if (S_ISLNK(st.st_mode)) {
      struct stat target;
      if (::stat(path.c_str(), &target) == 0 && S_ISDIR(target.st_mode)) f.tags.push_back(tag_state(dir, n));
      continue;
    }
    if (!S_ISDIR(st.st_mode)) continue;  // a user's file beside the tags
    if (!util::exists(join_path(path, "manifest.bin")) && !looks_like_checkpoint(path)) continue;  // a user's folder
    f.tags.push_back(tag_state(dir, n));
  }
  return f;
}

Choice choose_in(const Folder& f, const std::string& dir) {
  Choice c;
  c.found = f.newest.present || !f.tags.empty();
  std::vector<const TagState*> valid;
  for (const auto& t : f.tags)
    if (t.valid) valid.push_back(&t);
  const std::string& named = f.newest.tag;
  std::sort(valid.begin(), valid.end(), [&](const TagState* a, const TagState* b) {
    if (a->step != b->step) return a->step > b->step;
    if ((a->name == named) != (b->name == named)) return a->name == named;
    return a->name > b->name;
  });
  for (const auto* t : valid) c.tags.push_back(t->name);
  if (!c.found) return c;
  const std::string newest_path = join_path(dir, "newest");
  auto taking = [&]() {
    return valid.empty() ? std::string("no tag in it is valid")
                         : "taking '" + valid.front()->name + "' (step " + std::to_string(valid.front()->step) +
                               "), the valid checkpoint with the highest step";
  };
  if (!f.newest.present) {
    c.notes.push_back("'" + newest_path + "' is missing; " + taking());
  } else if (!f.newest.problem.empty()) {
    c.notes.push_back(f.newest.problem + "; " + taking());
  } else {
    auto it = std::find_if(f.tags.begin(), f.tags.end(), [&](const TagState& t) { return t.name == named; });
    if (it == f.tags.end()) {
      c.notes.push_back("'" + newest_path + "' names '" + named + "', which is not a checkpoint in '" + dir + "'; " +
                        taking());
    } else if (!it->valid) {
      c.notes.push_back("'" + newest_path + "' names '" + named + "', which is damaged: " + it->problem + "; " +
                        (valid.empty() ? taking() : "falling back to " + taking().substr(7)));
    } else if (valid.front()->name != named) {
      c.notes.push_back("'" + newest_path + "' names '" + named + "' (step " + std::to_string(it->step) + "), but '" +
                        valid.front()->name + "' (step " + std::to_string(valid.front()->step) +
                        ") is complete and newer (a save stopped before it updated 'newest'); taking it");
    }
  }
  if (!c.notes.empty())  // a fallback: say what else was passed over
    for (const auto& t : f.tags)
      if (!t.valid && t.name != named) c.notes.push_back("skipped the damaged tag '" + t.name + "': " + t.problem);
  return c;
}

}  // namespace internal

using namespace internal;

std::string newest(const std::string& dir) { return read_newest(dir).tag; }

std::vector<std::string> tags(const std::string& dir) {
  Folder f = scan(dir);
  std::vector<std::pair<int64_t, std::string>> found;
  for (const auto& t : f.tags)
    if (t.valid) found.emplace_back(t.step, t.name);
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [step, n] : found) out.push_back(n);
  return out;
}

Choice choose(const std::string& dir) { return choose_in(scan(dir), dir); }

}  // namespace partrain::ckpt

// partrain plan and partrain ckpt (see tools.hpp).
#include "app/tools.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "app/auto.hpp"
#include "app/parity.hpp"
#include "bindings/host.hpp"
#include "bindings/plan_run.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/compat.hpp"
#include "engine/dist/world.hpp"
#include "engine/models/registry.hpp"
#include "engine/plan/plan.hpp"
#include "engine/util/files.hpp"
#include "engine/util/text.hpp"

namespace partrain::app {

namespace {

int fail(const std::string& message) {
  std::cerr << "partrain: " << message << std::endl;
  return 1;
}


}  // namespace

std::string parse_count(const std::string& flag, const std::string& text, long long lo, long long hi, int& out) {
  std::string shown = text.size() > 40 ? text.substr(0, 40) + "..." : text;
  std::string range = std::to_string(lo) + " to " + std::to_string(hi);
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0])) || !end || *end != '\0')
    return flag + " '" + shown + "' is not a whole number (expected " + range + ")";
  if (errno == ERANGE || v < lo || v > hi) return flag + " " + shown + " is out of range: " + range;
  out = static_cast<int>(v);
  return "";
}

std::string parse_bytes(const std::string& flag, const std::string& text, int64_t& out) {
  std::string shown = text.size() > 40 ? text.substr(0, 40) + "..." : text;
  const std::string expected = " (expected a size such as 80GiB, 141GB or 8e10: a number, then B, KB, MB, GB, TB (powers of "
                               "1000), KiB, MiB, GiB, TiB or K, M, G, T (powers of 1024))";
  errno = 0;
  char* end = nullptr;
  double v = text.empty() || std::isspace(static_cast<unsigned char>(text[0])) ? NAN : std::strtod(text.c_str(), &end);
  if (!end || end == text.c_str() || !std::isfinite(v) || errno == ERANGE) return flag + " '" + shown + "' is not a size" + expected;
  std::string unit(end);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const std::pair<const char*, double> units[] = {
      {"", 1}, {"B", 1}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"K", 1024.0}, {"KIB", 1024.0},
      {"M", 1048576.0}, {"MIB", 1048576.0}, {"G", 1073741824.0}, {"GIB", 1073741824.0}, {"T", 1099511627776.0},
      {"TIB", 1099511627776.0}};
  for (const auto& [name, scale] : units)
    if (unit == name) {
      const double bytes = v * scale;
      if (!(bytes >= 1 << 20) || bytes > 1e18)
        return flag + " " + shown + " is out of range: 1 MiB to 1 EB" +
               (unit.empty() && bytes > 0 ? " (a number without a unit is bytes: " + shown + "GiB?)" : "");
      out = static_cast<int64_t>(bytes);
      return "";
    }
  return flag + " '" + shown + "': unknown unit '" + std::string(end) + "'" + expected;
}

std::string parse_seconds(const std::string& flag, const std::string& text, double lo, double hi, bool zero_is_off,
                          double& out) {
  std::string shown = text.size() > 40 ? text.substr(0, 40) + "..." : text;
  std::ostringstream range;
  range << "a number of seconds from " << lo << " to " << hi << (zero_is_off ? ", or 0 (off)" : "");
  bool decimal = !text.empty() && (std::isdigit(static_cast<unsigned char>(text[0])) || text[0] == '.');
  for (char c : text)
    decimal = decimal && (std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == 'e' || c == 'E' ||
                          c == '+' || c == '-');
  char* end = nullptr;
  const double v = decimal ? std::strtod(text.c_str(), &end) : 0;
  if (!decimal || !end || *end != '\0' || !std::isfinite(v))
    return flag + " '" + shown + "' is not " + range.str();
  if (!(v >= lo && v <= hi) && !(zero_is_off && v == 0)) return flag + " " + shown + " is out of range: " + range.str();
  out = v;
  return "";
}

CLI::Validator non_empty(const std::string& what) {
  return CLI::Validator([what](std::string& value) { return value.empty() ? "is empty (expected " + what + ")" : ""; },
                        "", "non-empty");
}

namespace {
// The flag of `app` nearest to `word` ("--thread" -> "--threads"), or "" when none is near.
std::string nearest_flag(const CLI::App& app, const std::string& word) {
  std::vector<std::string> names;
  for (const CLI::Option* option : app.get_options()) {
    for (const auto& n : option->get_lnames()) names.push_back("--" + n);
    for (const auto& n : option->get_snames()) names.push_back("-" + n);
  }
  return util::nearest_word(names, word);
}
}  // namespace

int parse_failed(CLI::App& app, const CLI::ParseError& e) {
  if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
  std::string what = e.what();
  if (what.size() > 200) what = what.substr(0, 200) + "...";
  // An unexpected flag: the nearest of the flags this command has, when one is near.
  std::string hint;
  if (dynamic_cast<const CLI::ExtrasError*>(&e)) {
    auto colon = what.find(": ");
    std::string word = colon == std::string::npos ? "" : what.substr(colon + 2);
    word = word.substr(0, word.find(' '));
    word = word.substr(0, word.find('='));
    if (word.size() > 1 && word[0] == '-') {
      std::string near = nearest_flag(app, word);
      if (!near.empty()) hint = "; did you mean " + near + "?";
    }
  }
  std::cerr << "partrain: " << what << hint << " (" << app.get_name() << " --help lists the flags)" << std::endl;
  return 1;
}

bool writable_beside(const std::string& path) {
  auto slash = path.find_last_of('/');
  std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  struct stat st;
  return ::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string unusable_name(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0 || errno == ENOENT) return "";
  return std::strerror(errno);
}

int split_at_script(CLI::App& app, int from, int argc, char** argv) {
  int split = from;
  while (split < argc) {
    std::string word = argv[split];
    if (word == "--") return split + 1;  // what follows is the script, whatever it looks like
    if (word.empty() || word[0] != '-' || word == "-") break;
    ++split;
    auto* option = word.rfind("--", 0) == 0 ? app.get_option_no_throw(word.substr(0, word.find('=')))
                                            : app.get_option_no_throw(word.substr(0, 2));
    bool inline_value = word.find('=') != std::string::npos || (word[1] != '-' && word.size() > 2);
    if (option && option->get_items_expected_min() > 0 && !inline_value && split < argc) ++split;  // its value
  }
  return split;
}

// `partrain plan --world N [--nproc-per-node K] [--json] [--save FILE] script.lua [args]`: runs
// the script once per virtual rank, on the meta device, with planned groups, up to its first
// optimizer step, and prints what every rank holds (docs/plan.md).
namespace {

// --pipeline-search, printed: the planned stages' bytes a micro-batch (a rank's chunks summed, the most over
// ranks), handed to partrain.plan's pipeline_search with the cap: `memory`, else the device's
// less the largest model state. False with `error` when there is nothing to search.
bool pipeline_search(const plan::Plan& p, int64_t memory, int64_t device, std::string* error) {
  int64_t activation = 0, pending = 0, state = 0, blocks = 0;
  bool measured = false, any = false;
  int microbatches = 0;
  for (const auto& r : p.ranks) {
    if (!r.stage.present) continue;
    any = true;
    microbatches = r.stage.microbatches;
    int64_t act = 0, pend = 0;
    for (const auto& c : r.stage.chunks) {
      act += std::max<int64_t>(c.activation_bytes, 0) + c.gradient_bytes;
      pend += c.pending_bytes > 0 ? c.pending_bytes : std::max<int64_t>(c.activation_bytes, 0);
      measured = measured || c.pending_bytes > 0;
      blocks = std::max(blocks, c.end_block);
    }
    activation = std::max(activation, act);
    pending = std::max(pending, pend);
    state = std::max(state, r.model_state_bytes());
  }
  if (!any || p.pipeline < 2) {
    *error = "the script's model is not pipelined (pt.mesh { pipeline = p } with p > 1 and pt.parallelize)";
    return false;
  }
  if (memory == 0) {
    if (device <= 0) {
      *error = "give the activation bytes a rank may hold (--pipeline-memory 2GiB) or the device memory (--device-memory)";
      return false;
    }
    memory = device - state;
    if (memory <= 0) {
      *error = "the model state alone (" + std::to_string(state) + " bytes a rank) fills the device memory";
      return false;
    }
  }
  std::ostringstream code;
  code << "local text, found = require('partrain.plan').pipeline_search { pp = " << p.pipeline
       << ", microbatches = " << microbatches << ", blocks = " << blocks << ", cap = " << memory
       << ", activation = " << activation << ", pending = " << pending
       << ", pending_measured = " << (measured ? "true" : "false") << " }\n"
       << "io.write(text)\n"
       << "if not found then error('no schedule fits the cap', 0) end";
  lua::Host host;
  std::string failed;
  const bool ok = host.run_string(code.str(), "=(plan --pipeline-search)", &failed);
  std::fflush(stdout);
  if (!ok) *error = failed.substr(0, failed.find("\nstack traceback:"));
  return ok;
}

}  // namespace

int run_plan(int argc, char** argv, int first) {
  CLI::App app{"partrain plan: what each rank of a layout will hold, without processes or memory.\n\n"
               "  partrain plan --world 8 [--nproc-per-node 4] [--json] [--save plan.bin] script.lua [args...]\n"
               "  partrain plan --auto --world 64 --nproc-per-node 8 [--device h100] [--verify] script.lua [args...]\n"
               "  partrain plan --calibrate device.lua [--nproc-per-node 4]\n",
               "partrain plan"};
  std::string world_text, nproc_text, memory_text;
  bool json = false, verbose = false;
  std::string save;
  app.add_option("--world", world_text, "ranks to plan for, 1-65536 (virtual: nothing is started)");
  app.add_option("--nproc-per-node", nproc_text, "ranks a machine, dividing --world (default: all on one); sets LOCAL_RANK");
  app.add_flag("--json", json, "print the plan as JSON");
  app.add_option("--save", save, "also write the plan here (cereal, binary) for a run to check with --plan")
      ->check(non_empty("the file to write the plan to"));
  app.add_option("--device-memory", memory_text, "one device's memory (80GiB, 141GB): the plan opens with whether "
                 "every rank's peak fits in it (default: this machine's first GPU's, when it has one)");
  bool search = false;
  std::string pipeline_memory_text;
  app.add_flag("--pipeline-search", search, "after the plan, the fastest pipeline schedule whose activations "
               "fit (pipeline.search over the built-ins and generated zero-bubble ones, from the planned stages' "
               "bytes), printed as a Lua plan to keep");
  app.add_option("--pipeline-memory", pipeline_memory_text, "the activation bytes a rank may hold for "
                 "--pipeline-search (default: the device memory less the largest model state)");
  AutoOptions auto_options;
  AutoFlags auto_flags;
  add_auto_flags(app, auto_flags, auto_options);
  app.add_flag("-v,--verbose", verbose, "list every logical tensor and the slices ranks hold, and show what rank 0's "
               "script prints (the others stay quiet)");
  int split = split_at_script(app, first, argc, argv);
  std::vector<std::string> rest;
  for (int i = split; i < argc; ++i) rest.emplace_back(argv[i]);
  std::vector<char*> flags{argv[0]};
  for (int i = first; i < split; ++i) flags.push_back(argv[i]);
  try {
    app.parse(static_cast<int>(flags.size()), flags.data());
  } catch (const CLI::ParseError& e) {
    return parse_failed(app, e);
  }
  int world = 0, nproc = 0;
  const bool automatic = auto_flags.automatic;
  const std::string& calibrate = auto_flags.calibrate;
  if (!calibrate.empty()) {
    std::string bad;
    if (app.count("--world") || automatic || !rest.empty())
      bad = "--calibrate measures this machine: give it --nproc-per-node K alone (no --world, --auto or script)";
    if (bad.empty() && app.count("--nproc-per-node")) bad = parse_count("--nproc-per-node", nproc_text, 1, 64, nproc);
    if (bad.empty() && util::is_plain_dir(calibrate)) bad = "--calibrate '" + calibrate + "' is a folder; give a file name";
    if (bad.empty() && !writable_beside(calibrate)) bad = "--calibrate '" + calibrate + "': its folder does not exist";
    if (!bad.empty()) return fail("plan: " + bad);
    return run_calibrate(calibrate, std::max(nproc, 1));
  }
  if (!app.count("--world")) return fail("plan: --world is required (the ranks to plan for)");
  std::string bad = parse_count("--world", world_text, 1, 1 << 16, world);
  if (bad.empty() && app.count("--nproc-per-node")) bad = parse_count("--nproc-per-node", nproc_text, 1, world, nproc);
  plan::TextOptions text_options;
  text_options.shards = verbose;
  if (bad.empty() && app.count("--device-memory")) {
    bad = parse_bytes("--device-memory", memory_text, text_options.device_memory);
    text_options.device_source = "--device-memory";
  } else if (compat::cuda_available() && compat::cuda_device_count() > 0) {
    text_options.device_memory = compat::cuda_total_memory(0);
    text_options.device_source = "cuda:0, " + compat::cuda_device_name(0);
  }
  int64_t pipeline_memory = 0;
  if (bad.empty() && app.count("--pipeline-memory")) {
    if (!search) bad = "--pipeline-memory is the cap of --pipeline-search, which is not given";
    else bad = parse_bytes("--pipeline-memory", pipeline_memory_text, pipeline_memory);
  }
  if (bad.empty()) bad = check_auto_flags(app, auto_flags, auto_options, search || !save.empty(), json);
  if (!bad.empty()) return fail("plan: " + bad);
  if (rest.empty()) return fail("plan: give the script to plan (partrain plan --world N script.lua)");
  if (nproc == 0) nproc = world;
  if (world % nproc != 0) return fail("plan: --nproc-per-node " + std::to_string(nproc) + " does not divide --world " +
                                      std::to_string(world));
  try {
    close(util::open_regular(rest[0], "script"));
    if (!save.empty() && util::is_plain_dir(save)) return fail("plan: --save '" + save + "' is a folder; give a file name");
    if (!save.empty() && !writable_beside(save)) return fail("plan: --save '" + save + "': its folder does not exist");
    // What plan::save refuses (a file that is not a plan, a link, a FIFO), refused before
    // planning: at --world 65536 planning takes minutes.
    if (!save.empty()) plan::check_save(save);
  } catch (const std::exception& e) {
    return fail("plan: " + util::message_of(e));
  }
  std::string script = rest[0];
  std::vector<std::string> script_args(rest.begin() + 1, rest.end());
  if (automatic) {
    auto_options.script = script;
    auto_options.args = script_args;
    auto_options.world = world;
    auto_options.nproc = nproc;
    auto_options.device = auto_flags.device;
    // Only an explicit --device-memory overrides the device's own (not this machine's GPU).
    auto_options.device_memory = text_options.device_source == "--device-memory" ? text_options.device_memory : 0;
    auto_options.json = json;
    auto_options.verbose = verbose;
    return run_auto(auto_options);
  }

  namespace plan = partrain::plan;
  at::set_num_threads(1);
  plan::set_planning(true);
  util::reset_peak(c10::kCPU);
  int64_t cpu_base = util::memory(c10::kCPU).allocated;
  auto start = std::chrono::steady_clock::now();
  lua::PlanRequest request;
  request.script = script;
  request.args = script_args;
  request.world = world;
  request.nproc = nproc;
  request.verbose = verbose;
  lua::Planned planned;
  std::string failed;
  if (!lua::plan_ranks(request, &planned, &failed)) return fail("plan: " + failed);
  plan::Plan result = std::move(planned.plan);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.cpu_peak_bytes = std::max<int64_t>(0, util::memory(c10::kCPU).peak - cpu_base);
  std::cout << (json ? plan::to_json(result) : plan::to_text(result, text_options)) << std::flush;
  if (json) std::cout << std::endl;
  if (search) {
    std::cout << "\n" << std::flush;
    std::string error;
    if (!pipeline_search(result, pipeline_memory, text_options.device_memory, &error))
      return fail("plan: --pipeline-search: " + error);
  }
  if (!save.empty()) {
    try {
      plan::save(result, save);
    } catch (const std::exception& e) {
      return fail("plan: " + partrain::util::message_of(e));
    }
    std::cerr << "partrain: plan saved to " << save << " (check a run against it: partrain --plan " << save
              << " ...)" << std::endl;
  }
  return 0;
}

// ---- partrain ckpt -------------------------------------------------------------------------

namespace {

// Whether `path`, existing or not, is `folder` or lies inside it (after links and `..` are resolved).
bool within(const std::string& path, const std::string& folder) {
  auto resolved = [](std::string p) {
    std::string tail;
    while (true) {  // the longest part that exists, resolved; the rest as written
      char buffer[PATH_MAX];
      if (::realpath(p.c_str(), buffer)) return std::string(buffer) + tail;
      auto slash = p.find_last_of('/');
      if (slash == std::string::npos) return (::realpath(".", buffer) ? std::string(buffer) : std::string(".")) + "/" + p + tail;
      tail = p.substr(slash) + tail;
      p = slash == 0 ? "/" : p.substr(0, slash);
    }
  };
  const std::string a = resolved(path), b = resolved(folder);
  return a == b || (a.size() > b.size() && a.compare(0, b.size(), b) == 0 && a[b.size()] == '/');
}

// Whether `path` is one tag's folder (it holds a manifest.bin, of whatever kind) rather than a
// checkpoint folder of tags.
bool is_tag_folder(const std::string& path) {
  struct stat st;
  return ::lstat((path + "/manifest.bin").c_str(), &st) == 0;
}

// A checkpoint folder (holding tags and `newest`) or one tag's folder, as a tag folder: --tag,
// else the tag a resume would take (saying why on stderr when it is not the one `newest` names).
std::string tag_folder(const std::string& path, const std::string& tag) {
  if (!tag.empty()) {
    TORCH_CHECK(util::safe_name(tag), "bad --tag '", tag, "': a tag is 1-128 characters from A-Z a-z 0-9 . _ -");
    TORCH_CHECK(util::is_plain_dir(path + "/" + tag), "no checkpoint '", tag, "' in '", path, "'");
    return path + "/" + tag;
  }
  if (is_tag_folder(path)) return path;
  auto choice = ckpt::choose(path);
  TORCH_CHECK(choice.found, "no checkpoint in '", path, "' (no 'newest' file and no tag folders)");
  for (const auto& note : choice.notes) std::cerr << "partrain: ckpt: " << note << "\n";
  TORCH_CHECK(!choice.tags.empty(), "no valid checkpoint in '", path, "' (partrain ckpt verify ", path, " says why)");
  return path + "/" + choice.tags.front();
}

int ckpt_inspect(const std::string& path, const std::string& tag) {
  std::string folder = tag_folder(path, tag);
  if (folder != path) {
    auto all = ckpt::tags(path);
    std::cout << "checkpoints in " << path << " (oldest first):";
    for (const auto& t : all) std::cout << " " << t;
    std::string newest = ckpt::newest(path);
    std::cout << "\nnewest: " << (newest.empty() ? "(missing or damaged)" : newest) << "\n\n";
  }
  std::cout << folder << "\n" << ckpt::describe(ckpt::read_manifest(folder)) << std::flush;
  return 0;
}

int ckpt_verify(const std::string& path) {
  int bad = 0;
  if (is_tag_folder(path)) {
    auto problems = ckpt::verify(path);
    if (problems.empty()) std::cout << path << ": ok\n";
    for (const auto& p : problems) std::cout << path << ": " << p << "\n";
    bad = problems.empty() ? 0 : 1;
  } else {
    for (const auto& f : ckpt::verify_folder(path)) {
      std::cout << f.path << ": " << f.message << "\n";
      bad += f.problem ? 1 : 0;
    }
  }
  std::cout << std::flush;
  return bad ? 1 : 0;
}

int ckpt_export(const std::string& path, const std::string& tag, const std::string& out) {
  std::string folder = tag_folder(path, tag);
  auto problems = ckpt::verify(folder);
  TORCH_CHECK(problems.empty(), "'", folder, "' is damaged: ", problems.front());
  auto m = ckpt::read_manifest(folder);
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& e : m.tensors)
    if (e.name.rfind("model/", 0) == 0) tensors[e.name.substr(6)] = ckpt::read_tensor(folder, m, e);
  const auto* family = models::family_of_type(m.model_type);
  const auto* hf = family && family->has_hf() ? &family->hf : nullptr;
  // A tie is stored once in a checkpoint (by its first name): Hugging Face stores the source
  // alone too. A tensor under the tied name is the model's own (LLaMA with tie = false) and is
  // kept, unless it merely repeats its source.
  if (hf)
    for (const auto& [tied, source] : hf->tied) {
      auto t = tensors.find(tied), s = tensors.find(source);
      if (t != tensors.end() && s != tensors.end() && t->second.equal(s->second)) tensors.erase(t);
    }
  ckpt::write_safetensors(out, tensors, hf);
  std::cout << "wrote " << tensors.size() << " tensors of step " << m.step << " to " << out
            << (hf ? " (" + hf->layout + " layout)" : "") << std::endl;
  return 0;
}

}  // namespace

int run_ckpt(int argc, char** argv, int first) {
  CLI::App app{"partrain ckpt: look after checkpoints without starting ranks.\n\n"
               "  partrain ckpt inspect DIR [--tag T]           tensors, shapes, shards, sizes, mesh, step\n"
               "  partrain ckpt verify DIR                      check every tag, file and newest (exit 1 on any damage)\n"
               "  partrain ckpt convert SRC DST --tensor N --data M --pipeline P [--tag T]   reshard offline\n"
               "  partrain ckpt export DIR out.safetensors [--tag T]            weights for the PyTorch/HF world\n",
               "partrain ckpt"};
  app.require_subcommand(1);
  std::string dir, dst, out, tag, tensor_text, data_text, pipeline_text;
  auto* inspect = app.add_subcommand("inspect", "describe a checkpoint (the newest, or --tag)");
  inspect->add_option("dir", dir, "a checkpoint folder or one tag's folder")->required()->check(non_empty("a folder"));
  inspect->add_option("--tag", tag, "which tag (default: newest)")->check(non_empty("a tag name"));
  auto* verify = app.add_subcommand("verify", "verify every tag: files, sizes, checksums, coverage");
  verify->add_option("dir", dir, "a checkpoint folder or one tag's folder")->required()->check(non_empty("a folder"));
  auto* convert = app.add_subcommand("convert", "rewrite a checkpoint as another layout would have saved it");
  convert->add_option("src", dir, "the checkpoint folder (or tag folder) to read")->required()->check(non_empty("a folder"));
  convert->add_option("dst", dst, "the checkpoint folder to write (the tag keeps its name)")
      ->required()
      ->check(non_empty("a folder"));
  convert->add_option("--tensor", tensor_text, "tensor-parallel size of the new layout, 1-65536 (default 1)");
  convert->add_option("--data", data_text, "data-parallel size of the new layout, 1-65536 (default 1)");
  convert->add_option("--pipeline", pipeline_text,
                      "pipeline-parallel size of the new layout, 1-65536 and at most the model's blocks (default 1)");
  convert->add_option("--tag", tag, "which tag (default: newest)")->check(non_empty("a tag name"));
  auto* exp = app.add_subcommand("export", "write the model's logical weights as .safetensors");
  exp->add_option("dir", dir, "a checkpoint folder or one tag's folder")->required()->check(non_empty("a folder"));
  exp->add_option("out", out, "the .safetensors file to write")->required()->check(non_empty("a file name"));
  exp->add_option("--tag", tag, "which tag (default: newest)")->check(non_empty("a tag name"));
  if (first < argc && argv[first][0] != '-') {
    std::string command = argv[first];
    if (command != "inspect" && command != "verify" && command != "convert" && command != "export")
      return fail("ckpt: '" + command.substr(0, 80) + "' is not a command (inspect, verify, convert or export)");
  }
  std::vector<char*> args{argv[0]};
  for (int i = first; i < argc; ++i) args.push_back(argv[i]);
  try {
    app.parse(static_cast<int>(args.size()), args.data());
  } catch (const CLI::ParseError& e) {
    return parse_failed(app, e);
  }
  // The arguments, before anything is read: sizes in range, a tag that is a plain name, folders
  // that exist, and outputs that are files in an existing folder.
  int tensor = 1, data = 1, pipeline = 1;
  std::string bad;
  if (convert->count("--tensor")) bad = parse_count("--tensor", tensor_text, 1, 1 << 16, tensor);
  if (bad.empty() && convert->count("--data")) bad = parse_count("--data", data_text, 1, 1 << 16, data);
  if (bad.empty() && convert->count("--pipeline")) bad = parse_count("--pipeline", pipeline_text, 1, 1 << 16, pipeline);
  if (bad.empty() && !tag.empty() && !util::safe_name(tag))
    bad = "--tag '" + tag.substr(0, 80) + "' is not a tag name (letters, digits, '.', '_', '-'; not starting with '.' or '-')";
  struct stat st;
  if (bad.empty() && ::stat(dir.c_str(), &st) != 0)
    bad = "cannot read the checkpoint folder '" + dir + "': " + std::strerror(errno);
  else if (bad.empty() && !S_ISDIR(st.st_mode))
    bad = "'" + dir + "' is not a folder; a checkpoint is a folder";
  if (bad.empty() && *convert && ::stat(dst.c_str(), &st) == 0 && !S_ISDIR(st.st_mode))
    bad = "the destination '" + dst + "' exists and is not a folder";
  if (bad.empty() && *convert && !writable_beside(dst)) bad = "the destination '" + dst + "': its folder does not exist";
  if (bad.empty() && *convert && is_tag_folder(dst))
    bad = "the destination '" + dst + "' is one tag's folder (it holds a manifest.bin); give the checkpoint folder " +
          "the converted tag goes into";

  if (bad.empty() && *exp && util::is_plain_dir(out)) bad = "the output '" + out + "' is a folder; give a file name";
  if (bad.empty() && *exp && !writable_beside(out)) bad = "the output '" + out + "': its folder does not exist";
  if (!bad.empty()) return fail("ckpt: " + bad);
  try {
    if (*inspect) return ckpt_inspect(dir, tag);
    if (*verify) return ckpt_verify(dir);
    if (*exp) return ckpt_export(dir, tag, out);
    std::string folder = tag_folder(dir, tag);
    TORCH_CHECK(!within(dst, folder), "the destination '", dst, "' is inside the tag being converted ('", folder,
                "'); give a folder outside it");
    ckpt::convert(folder, dst, tensor, data, pipeline);
    std::cout << "wrote " << folder.substr(folder.find_last_of('/') + 1) << " to " << dst << " as tensor " << tensor
              << " x data " << data << " x pipeline " << pipeline << std::endl;
    return 0;
  } catch (const std::exception& e) {
    return fail("ckpt: " + util::message_of(e));
  }
}

}  // namespace partrain::app

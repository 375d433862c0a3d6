// GPT-2 (see gpt2.hpp), and its family's descriptor: builder, Hugging Face names, policy.
#include "engine/models/gpt2.hpp"

#include <cmath>
#include <limits>
#include <sstream>

#include "engine/models/generate.hpp"
#include "engine/models/registry.hpp"
#include "engine/models/transformer.hpp"
#include "engine/nn/functional.hpp"
#include "engine/nn/init.hpp"
#include "engine/parallel/tensor_parallel.hpp"

namespace partrain::models {

namespace {
nn::ModulePtr linear(int64_t in, int64_t out, bool bias = true) {
  nn::LinearOptions o(in, out);
  o.bias = bias;
  return std::make_shared<nn::Linear>(o);
}
nn::ModulePtr layer_norm(const Gpt2Options& o) {
  nn::LayerNormOptions ln(o.dim);
  ln.eps = o.eps;
  return std::make_shared<nn::LayerNorm>(ln);
}
// This rank's part of what a tensor-parallel layer gives, as (parts, index): the heads of a
// column-split c_attn (its output not gathered), or the part of the sequence a sequence-parallel
// row layer's output holds. (1, 0): the whole.
std::pair<int64_t, int64_t> heads_part(const nn::Module& c_attn) {
  auto* column = dynamic_cast<const parallel::ColumnParallelLinear*>(&c_attn);
  if (!column || column->gather_output || !column->group || column->group->size() == 1) return {1, 0};
  return {column->group->size(), column->group->rank()};
}
std::pair<int64_t, int64_t> sequence_part(const nn::Module& c_proj) {
  auto* row = dynamic_cast<const parallel::RowParallelLinear*>(&c_proj);
  if (!row || !row->sequence_parallel || !row->group || row->group->size() == 1) return {1, 0};
  return {row->group->size(), row->group->rank()};
}
}  // namespace

Gpt2Attention::Gpt2Attention(const Gpt2Options& o)
    : nn::Unary("GPT2Attention"), heads(o.heads), head_dim(o.dim / o.heads), dropout(o.dropout),
      attn_dropout(o.attn_dropout < 0 ? o.dropout : o.attn_dropout), flash_attention(o.flash_attention) {
  set_child("c_attn", linear(o.dim, 3 * o.dim));
  set_child("c_proj", linear(o.dim, o.dim));
}

c10::optional<double> Gpt2Attention::attribute(const std::string& name) const {
  if (name == "heads" || name == "n_head") return static_cast<double>(heads);
  if (name == "flash_attention") return flash_attention ? 1 : 0;
  return c10::nullopt;
}

void Gpt2Attention::set_attribute(const std::string& name, double value) {
  if (name == "flash_attention") {
    TORCH_CHECK(value == 0 || value == 1, "GPT2Attention: flash_attention must be 0 or 1, got ", value);
    flash_attention = value == 1;
    return;
  }
  TORCH_CHECK(name == "heads" || name == "n_head", "GPT2Attention has no attribute '", name,
              "' (it has heads, flash_attention)");
  TORCH_CHECK(value > 0 && value == static_cast<double>(static_cast<int64_t>(value)),
              "GPT2Attention: heads must be a positive integer, got ", value);
  heads = static_cast<int64_t>(value);
}

Tensor Gpt2Attention::forward(const Tensor& x) {
  auto& c_attn = *child("c_attn");
  // (B, T, 3 * heads * hd); under sequence parallelism x holds T/t positions and c_attn gathers T.
  auto qkv = c_attn.forward({x});
  const int64_t B = qkv.size(0), T = qkv.size(1), width = qkv.size(-1) / 3;
  TORCH_CHECK(qkv.size(-1) == 3 * heads * head_dim, "GPT2Attention: ", heads, " heads of ", head_dim,
              " need q, k and v of ", 3 * heads * head_dim, " features from c_attn, got ", qkv.size(-1),
              " (under tensor parallelism the heads must be divided like c_attn's output)");
  const int64_t hd = head_dim;
  auto split = qkv.view({B, T, 3, heads, hd}).permute({2, 0, 3, 1, 4});  // (3, B, heads, T, hd)
  auto q = split[0], k = split[1], v = split[2];
  const double p = is_training() ? attn_dropout : 0.0;
  const auto context = context_group();
  // c_proj, then the residual branch's dropout (Hugging Face's resid_dropout), under sequence
  // (and context) parallelism on this rank's positions of the whole branch's mask.
  auto project = [&](const Tensor& y) {
    const auto [positions, mine] = sequence_part(*child("c_proj"));
    return parallel::sequence_dropout(child("c_proj")->forward({y}), dropout, is_training(), context, positions, mine);
  };
  if (auto* cache = KvCache::current()) {  // generating: this input's keys after the cached ones
    TORCH_CHECK(!context, "GPT2Attention: generation is not supported under context parallelism (context=",
                context->size(), "): generate with a model of context=1");
    auto [keys, values] = cache->extend(*this, k, v);
    nn::AttentionOptions a;
    a.causal = true;
    a.training = false;
    auto y = nn::scaled_dot_product_attention(q, keys, values, a).transpose(1, 2).reshape({B, T, width});
    return project(y);
  }
  if (context) {  // this rank's rows of the sequence, attending to all of it
    TORCH_CHECK(p == 0, "GPT2Attention: dropout on the attention probabilities (attn_dropout=", attn_dropout,
                ") is not supported under context parallelism (context=", context->size(),
                "): its mask would be drawn for the whole sequence; set attn_dropout = 0 (dropout still applies to "
                "the embeddings and residual branches)");
    auto y = parallel::context_attention(q, k, v, context_).transpose(1, 2).reshape({B, T, width});
    return project(y);
  }
  // Heads split over a tensor group drop with the mask the whole model's heads would have; the
  // fused kernel draws its own, the same on every rank, so it is left to unsplit heads then.
  const auto [parts, part] = heads_part(c_attn);
  if (flash_attention && (p == 0 || parts == 1)) {
    auto y = at::scaled_dot_product_attention(q, k, v, {}, p, /*is_causal=*/true).transpose(1, 2).reshape({B, T, width});
    return project(y);
  }
  auto scores = q.matmul(k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));  // (B, heads, T, T)
  auto mask = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
  auto probs = nn::dropout_part(scores.masked_fill(mask, -std::numeric_limits<float>::infinity()).softmax(-1),
                                attn_dropout, is_training(), 1, parts, part);
  auto y = probs.matmul(v).transpose(1, 2).reshape({B, T, width});  // (B, T, heads * hd)
  return project(y);
}

std::string Gpt2Attention::extra_repr() const {
  return "heads=" + std::to_string(heads) + ", head_dim=" + std::to_string(head_dim);
}

void Gpt2Attention::check(const std::string& path) const {
  auto c_attn = child("c_attn"), c_proj = child("c_proj");
  TORCH_CHECK(c_attn && c_proj, path, ": GPT2Attention needs its c_attn and c_proj");
  auto qkv = c_attn->output_features();
  if (!qkv || qkv->width < 0) return;  // a module that does not say (written in Lua)
  TORCH_CHECK(qkv->width % 3 == 0, path, ": c_attn gives ", qkv->describe(), ", not q, k and v of equal width");
  if (qkv->parts > 1)
    TORCH_CHECK(qkv->fused == 3, path, ": c_attn's output (q, k and v side by side) is split over tensor=", qkv->parts,
                qkv->fused == 1 ? " in one piece" : " in " + std::to_string(qkv->fused) + " fused parts",
                ", so a rank would not hold the q, k and v of the same heads: split it with P.column { fused = 3 }");
  const int64_t width = qkv->width / qkv->parts / 3;  // q's features here
  TORCH_CHECK(heads * head_dim == width, path, ": ", heads, " heads of ", head_dim, " features make ", heads * head_dim,
              ", but c_attn gives ", width, " features of q here",
              qkv->parts > 1 ? " (its output is split over tensor=" + std::to_string(qkv->parts) + ")" : std::string(),
              ": the heads this module computes must be the heads c_attn's part holds (divide n_head by the tensor "
              "size: attributes = { [\"attn.n_head\"] = P.divide_by_tensor })");
  // What the heads give c_proj: this rank's heads, side by side (a contiguous part of the width).
  nn::Features heads_out{qkv->width / 3, qkv->parts, 1};
  auto takes = c_proj->input_features();
  TORCH_CHECK(!takes || heads_out.matches(*takes), path, ": the heads give ", heads_out.describe(), ", but c_proj (",
              c_proj->type(), ") takes ", takes ? takes->describe() : "", heads_out.parts > 1 && takes && takes->parts == 1
              ? ": split c_proj's input too (P.row)" : (heads_out.parts == 1 && takes && takes->parts > 1
              ? ": c_proj expects its part of split heads (split c_attn with P.column { fused = 3 })" : ""));
}

Gpt2Mlp::Gpt2Mlp(const Gpt2Options& o) : nn::Unary("GPT2MLP"), dropout(o.dropout) {
  set_child("c_fc", linear(o.dim, 4 * o.dim));
  set_child("c_proj", linear(4 * o.dim, o.dim));
}

Tensor Gpt2Mlp::forward(const Tensor& x) {
  auto h = at::gelu(child("c_fc")->forward({x}), "tanh");  // (B, T, 4 dim)
  const auto [parts, part] = sequence_part(*child("c_proj"));  // sequence-parallel: this rank's positions
  return parallel::sequence_dropout(child("c_proj")->forward({h}), dropout, is_training(), context_group(), parts, part);
}

void Gpt2Mlp::check(const std::string& path) const {
  nn::check_chain({{"c_fc", child("c_fc")}, {"c_proj", child("c_proj")}}, path);
}

Gpt2Block::Gpt2Block(const Gpt2Options& o) : nn::Unary("GPT2Block") {
  set_child("ln_1", layer_norm(o));
  set_child("attn", std::make_shared<Gpt2Attention>(o));
  set_child("ln_2", layer_norm(o));
  set_child("mlp", std::make_shared<Gpt2Mlp>(o));
}

Tensor Gpt2Block::forward(const Tensor& x) {
  auto h = x + child("attn")->forward({child("ln_1")->forward({x})});
  return h + child("mlp")->forward({child("ln_2")->forward({h})});
}

void Gpt2Block::check(const std::string& path) const {
  const int64_t dim = child("ln_1")->input_features() ? child("ln_1")->input_features()->width : -1;
  for (const char* branch : {"attn", "mlp"}) {
    auto out = child(branch)->output_features();
    TORCH_CHECK(!out || dim < 0 || out->matches(nn::Features{dim}), path, ": ", branch, " gives ", out->describe(),
                ", but the residual stream needs ", nn::Features{dim}.describe());
  }
  nn::check_chain({{"ln_1", child("ln_1")}, {"attn", child("attn")}}, path);
  nn::check_chain({{"ln_2", child("ln_2")}, {"mlp", child("mlp")}}, path);
  check_sequence(*this, path, {"ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"});
}

void Gpt2::check(const std::string& path) const {
  check_vocab_head(*this, path, "lm_head");
  nn::check_chain({{"ln_f", child("ln_f")}, {"lm_head", child("lm_head")}}, path);
  std::vector<std::string> layers = {"ln_f", "lm_head"};
  for (const auto& [name, block] : child("h")->children_named()) {
    layers.push_back("h." + name + ".ln_1");
    layers.push_back("h." + name + ".attn.c_attn");
  }
  check_sequence(*this, path, layers);
  auto split = child("ln_f")->sequence_split();
  TORCH_CHECK(!(split && *split) || forward_replaced(), path, ": its layers are sequence-parallel, but GPT2's own "
              "forward never splits the sequence: replace it (policies/gpt2.lua does, under sequence_parallel)");
}

Gpt2::Gpt2(const Gpt2Options& o) : nn::Unary("GPT2"), options(o) {
  TORCH_CHECK(o.vocab > 0 && o.seq > 0 && o.dim > 0 && o.heads > 0 && o.layers > 0,
              "gpt2 needs positive sizes: vocab=", o.vocab, " seq=", o.seq, " dim=", o.dim, " heads=", o.heads,
              " layers=", o.layers);
  TORCH_CHECK(o.layers <= kMaxLayers, "gpt2: layers must be at most ", kMaxLayers, ", got ", o.layers);
  TORCH_CHECK(o.dim % o.heads == 0, "gpt2: heads=", o.heads, " does not divide dim=", o.dim);
  TORCH_CHECK(o.dropout >= 0 && o.dropout < 1, "gpt2: dropout must be in [0, 1), got ", o.dropout);
  TORCH_CHECK(o.attn_dropout < 1 && !std::isnan(o.attn_dropout), "gpt2: attn_dropout must be in [0, 1) (or < 0: dropout's), got ",
              o.attn_dropout);
  TORCH_CHECK(o.eps >= 0 && std::isfinite(o.eps), "gpt2: eps must be a finite number >= 0, got ", o.eps);
  set_child("wte", std::make_shared<nn::Embedding>(nn::EmbeddingOptions(o.vocab, o.dim)));
  set_child("wpe", std::make_shared<nn::Embedding>(nn::EmbeddingOptions(o.seq, o.dim)));
  auto h = std::make_shared<nn::Sequential>();
  for (int64_t i = 0; i < o.layers; ++i) h->append(std::make_shared<Gpt2Block>(o));
  set_child("h", h);
  set_child("ln_f", layer_norm(o));
  set_child("lm_head", linear(o.dim, o.vocab, /*bias=*/false));
}

Tensor Gpt2::forward(const Tensor& ids) { return head(child("h")->forward({embed(ids)})); }

Tensor Gpt2::embed(const Tensor& ids) {
  return parallel::sequence_dropout(embeddings(ids), options.dropout, is_training(), context_group(), 1, 0);
}

bool Gpt2::check_batch(const Tensor& x, const Tensor& y, const std::string& loss, int64_t ignore_index) {
  return check_lm_batch("GPT2", x, y, options.vocab, options.seq, loss, ignore_index, sequence_group(*this));
}

Tensor Gpt2::embeddings(const Tensor& ids) {
  const int64_t first = KvCache::current() ? KvCache::current()->offset : 0;  // generating: after the cache
  check_token_ids("GPT2", ids, options.vocab, options.seq, first, ids.is_cpu());
  const int64_t T = ids.size(1);
  Tensor pos;
  if (auto context = context_group()) {  // this rank's rows of a sequence of T * context positions
    TORCH_CHECK(T * context->size() <= options.seq, "GPT2: a sequence of ", T * context->size(), " positions (", T,
                " here, context=", context->size(), ") is longer than seq=", options.seq);
    pos = parallel::context_positions(T, context).to(ids.device());
  } else {
    pos = torch::arange(first, first + T, torch::TensorOptions().dtype(torch::kInt64).device(ids.device()));
  }
  return child("wte")->forward({ids}) + child("wpe")->forward({pos});  // (B, T, dim)
}

Tensor Gpt2::stage_in(const Tensor& ids) {
  // Sequence parallelism: the group of a LayerNorm that sees this rank's part of the sequence.
  auto group = sequence_group(*this);
  if (!group) return embed(ids);
  auto x = parallel::split_sequence(embeddings(ids), group);  // (B, T/t, dim)
  return parallel::sequence_dropout(x, options.dropout, is_training(), context_group(), group->size(), group->rank());
}

Tensor Gpt2::head(const Tensor& x) {
  return child("lm_head")->forward({child("ln_f")->forward({x})});  // (B, T, vocab)
}

c10::optional<double> Gpt2::attribute(const std::string& name) const {
  if (name == "dropout") return options.dropout;
  if (name == "seq") return static_cast<double>(options.seq);
  if (name == "context") return context_group() ? context_group()->size() : 1;
  return c10::nullopt;
}

std::vector<nn::ConfigField> Gpt2::config() const {
  const auto& o = options;
  // heads and eps change the function and no shape; vocab, seq (wpe), dim and layers are pinned
  // by the parameters; dropout and the attention kernel may change when a run resumes.
  return {{"vocab", double(o.vocab)},
          {"seq", double(o.seq)},
          {"dim", double(o.dim)},
          {"heads", double(o.heads), true},
          {"layers", double(o.layers)},
          {"dropout", o.dropout},
          {"eps", o.eps, true},
          {"flash_attention", o.flash_attention ? 1.0 : 0.0}};
}

std::string Gpt2::extra_repr() const {
  std::ostringstream s;
  s << "vocab=" << options.vocab << ", seq=" << options.seq << ", dim=" << options.dim << ", heads=" << options.heads
    << ", layers=" << options.layers << (options.flash_attention ? ", flash_attention" : "");
  return s.str();
}

bool Gpt2::init_tensor(const std::string& path, Tensor& t, at::Generator& gen) const {
  auto ends = [&](const std::string& end) {
    return path.size() >= end.size() && path.compare(path.size() - end.size(), end.size(), end) == 0;
  };
  const double std = 0.02, residual = 0.02 / std::sqrt(2.0 * static_cast<double>(options.layers));
  if (path == "wpe.weight") t.normal_(0, 0.01, gen);
  else if (path.find("ln_") != std::string::npos) t.fill_(ends(".weight") ? 1.0 : 0.0);  // LayerNorm at (1, 0)
  else if (ends(".bias")) t.zero_();
  else if (ends("c_proj.weight")) t.normal_(0, residual, gen);
  else if (ends(".weight")) t.normal_(0, std, gen);  // wte (and lm_head, tied to it), c_attn, c_fc
  else return false;
  return true;
}

nn::ModulePtr gpt2(const Gpt2Options& o) {
  return nn::build_initialized([&] {
    auto model = std::make_shared<Gpt2>(o);
    // lm_head shares wte's weight (both [vocab, dim]).
    model->child("lm_head")->set_parameter("weight", model->child("wte")->param("weight"));
    return nn::ModulePtr(model);
  }, o.dtype);
}

// ---- The family's descriptor ---------------------------------------------------------------

namespace {
// Hugging Face's Conv1D layers: weights stored [in, out], where these Linear layers hold [out, in].
bool is_conv1d(const std::string& name) {
  for (const char* suffix : {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"}) {
    std::string s = suffix;
    if (name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) return true;
  }
  return false;
}
}  // namespace

Family gpt2_family() {
  Family f;
  f.name = "gpt2";
  f.type = "GPT2";
  f.default_policy = "policies.gpt2";
  f.build = [](OptionReader& r) {
    Gpt2Options o;
    o.vocab = r.integer("vocab", o.vocab);
    o.seq = r.integer("seq", o.seq);
    o.dim = r.integer("dim", o.dim);
    o.heads = r.integer("heads", o.heads);
    o.layers = r.integer("layers", o.layers);
    o.dropout = r.number("dropout", o.dropout);
    o.attn_dropout = r.number("attn_dropout", o.attn_dropout);
    o.eps = r.number("eps", o.eps);
    o.flash_attention = r.boolean("flash_attention", o.flash_attention);
    o.dtype = nn::model_dtype(r.string("dtype", "float32"));
    return gpt2(o);
  };
  // GPT2Model's names are these; GPT2LMHeadModel puts "transformer." before them. lm_head is
  // tied to wte, and Hugging Face files store wte alone.
  f.hf.layout = "Hugging Face GPT-2";
  f.hf.from_hf = [](const std::string& hf) { return hf.rfind("transformer.", 0) == 0 ? hf.substr(12) : hf; };
  f.hf.to_hf = [](const std::string& name) { return name; };
  f.hf.transposed = is_conv1d;
  f.hf.ignored = [](const std::string& hf) {  // the causal-mask buffers partrain computes
    auto ends_with = [&](const std::string& end) {
      return hf.size() >= end.size() && hf.compare(hf.size() - end.size(), end.size(), end) == 0;
    };
    return ends_with(".attn.bias") || ends_with(".attn.masked_bias");
  };
  f.hf.tied = {{"lm_head.weight", "wte.weight"}};
  return f;
}

}  // namespace partrain::models

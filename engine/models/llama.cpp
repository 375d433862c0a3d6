// LLaMA (see llama.hpp), and its family's descriptor: builder, Hugging Face names, policy.
#include "engine/models/llama.hpp"

#include <sstream>
#include <tuple>

#include "engine/models/generate.hpp"
#include "engine/models/registry.hpp"
#include "engine/models/transformer.hpp"
#include "engine/nn/functional.hpp"
#include "engine/nn/init.hpp"
#include "engine/parallel/tensor_parallel.hpp"

namespace partrain::models {

namespace {
nn::ModulePtr linear(int64_t in, int64_t out) {
  nn::LinearOptions o(in, out);
  o.bias = false;
  return std::make_shared<nn::Linear>(o);
}
nn::ModulePtr rms_norm(const LlamaOptions& o) {
  nn::RMSNormOptions r(o.dim);
  r.eps = o.eps;
  return std::make_shared<nn::RMSNorm>(r);
}
int64_t kv_heads_of(const LlamaOptions& o) { return o.kv_heads > 0 ? o.kv_heads : o.heads; }
int64_t hidden_of(const LlamaOptions& o) { return o.hidden > 0 ? o.hidden : (8 * o.dim / 3 + 31) / 32 * 32; }
bool positive_whole(double v) { return v > 0 && v == static_cast<double>(static_cast<int64_t>(v)); }
parallel::MoEOptions moe_options(const LlamaOptions& o) {
  parallel::MoEOptions m;
  m.dim = o.dim;
  m.hidden = hidden_of(o);
  m.experts = o.experts;
  m.top_k = o.top_k;
  m.normalize = o.normalize;
  m.aux_loss = o.aux_loss;
  m.z_loss = o.z_loss;
  m.capacity_factor = o.capacity_factor;
  return m;
}
}  // namespace

LlamaAttention::LlamaAttention(const LlamaOptions& o)
    : nn::Unary("LlamaAttention"), heads(o.heads), kv_heads(kv_heads_of(o)), head_dim(o.dim / o.heads),
      rope_base(o.rope_base), flash_attention(o.flash_attention) {
  set_child("q_proj", linear(o.dim, heads * head_dim));
  set_child("k_proj", linear(o.dim, kv_heads * head_dim));
  set_child("v_proj", linear(o.dim, kv_heads * head_dim));
  set_child("o_proj", linear(heads * head_dim, o.dim));
}

c10::optional<double> LlamaAttention::attribute(const std::string& name) const {
  if (name == "heads") return static_cast<double>(heads);
  if (name == "kv_heads") return static_cast<double>(kv_heads);
  if (name == "flash_attention") return flash_attention ? 1 : 0;
  return c10::nullopt;
}

void LlamaAttention::set_attribute(const std::string& name, double value) {
  if (name == "flash_attention") {
    TORCH_CHECK(value == 0 || value == 1, "LlamaAttention: flash_attention must be 0 or 1, got ", value);
    flash_attention = value == 1;
    return;
  }
  TORCH_CHECK(name == "heads" || name == "kv_heads", "LlamaAttention has no attribute '", name,
              "' (it has heads, kv_heads, flash_attention)");
  TORCH_CHECK(positive_whole(value), "LlamaAttention: ", name, " must be a positive integer, got ", value);
  (name == "heads" ? heads : kv_heads) = static_cast<int64_t>(value);
}

Tensor LlamaAttention::forward(const Tensor& x) {
  // Under sequence parallelism x holds T/t positions and the projections gather all T.
  auto q = child("q_proj")->forward({x}), k = child("k_proj")->forward({x}), v = child("v_proj")->forward({x});
  const int64_t B = q.size(0), T = q.size(1), hd = head_dim;
  TORCH_CHECK(q.size(-1) == heads * hd && k.size(-1) == kv_heads * hd && v.size(-1) == kv_heads * hd,
              "LlamaAttention: ", heads, " query and ", kv_heads, " key/value heads of ", hd, " need q of ", heads * hd,
              " and k, v of ", kv_heads * hd, " features, got ", q.size(-1), ", ", k.size(-1), ", ", v.size(-1),
              " (under tensor parallelism heads and kv_heads must be divided like the projections)");
  q = q.view({B, T, heads, hd}).transpose(1, 2);  // (B, heads, T, hd)
  k = k.view({B, T, kv_heads, hd}).transpose(1, 2);
  v = v.view({B, T, kv_heads, hd}).transpose(1, 2);
  auto* cache = KvCache::current();  // generating: positions continue after the cached ones
  const auto context = context_group();
  TORCH_CHECK(!(cache && context), "LlamaAttention: generation is not supported under context parallelism (context=",
              context ? context->size() : 1, "): generate with a model of context=1");
  const int64_t first = cache ? cache->offset : 0;
  auto positions = context ? parallel::context_positions(T, context).to(x.device())  // this rank's rows
                           : torch::arange(first, first + T, torch::TensorOptions().dtype(torch::kInt64).device(x.device()));
  auto [cos, sin] = nn::rotary_tables(hd, positions, rope_base, q.scalar_type());
  q = nn::apply_rotary(q, cos, sin);
  k = nn::apply_rotary(k, cos, sin);
  nn::AttentionOptions a;
  a.causal = true;
  a.training = is_training();
  if (cache) {
    std::tie(k, v) = cache->extend(*this, k, v);
    auto y = nn::scaled_dot_product_attention(q, k, v, a);
    return child("o_proj")->forward({y.transpose(1, 2).reshape({B, T, heads * hd})});
  }
  if (context) {
    auto y = parallel::context_attention(q, k, v, context_);
    return child("o_proj")->forward({y.transpose(1, 2).reshape({B, T, heads * hd})});
  }
  // The fused kernel where asked for; the same math in steps otherwise.
  auto y = flash_attention ? at::scaled_dot_product_attention(q, k.repeat_interleave(heads / kv_heads, 1),
                                                              v.repeat_interleave(heads / kv_heads, 1), {}, 0.0,
                                                              /*is_causal=*/true)
                           : nn::scaled_dot_product_attention(q, k, v, a);
  return child("o_proj")->forward({y.transpose(1, 2).reshape({B, T, heads * hd})});
}

std::string LlamaAttention::extra_repr() const {
  return "heads=" + std::to_string(heads) + ", kv_heads=" + std::to_string(kv_heads) +
         ", head_dim=" + std::to_string(head_dim);
}

void LlamaAttention::check(const std::string& path) const {
  auto q = child("q_proj"), k = child("k_proj"), v = child("v_proj"), o = child("o_proj");
  TORCH_CHECK(q && k && v && o, path, ": LlamaAttention needs its q_proj, k_proj, v_proj and o_proj");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, path, ": ", heads, " query heads are not a multiple of ",
              kv_heads, " key/value heads");
  auto here = [](const c10::optional<nn::Features>& f) { return f->width / f->parts; };
  auto qf = q->output_features(), kf = k->output_features(), vf = v->output_features();
  if (qf && qf->width >= 0)
    TORCH_CHECK(heads * head_dim == here(qf), path, ": ", heads, " heads of ", head_dim, " make ", heads * head_dim,
                ", but q_proj gives ", here(qf), " features here: divide heads like q_proj's output "
                "(attributes = { [\"self_attn.heads\"] = P.divide_by_tensor })");
  for (const auto& [name, f] : {std::make_pair("k_proj", kf), std::make_pair("v_proj", vf)})
    if (f && f->width >= 0)
      TORCH_CHECK(kv_heads * head_dim == here(f), path, ": ", kv_heads, " key/value heads of ", head_dim, " make ",
                  kv_heads * head_dim, ", but ", name, " gives ", here(f), " features here: divide kv_heads like ",
                  name, "'s output (attributes = { [\"self_attn.kv_heads\"] = P.divide_by_tensor })");
  if (qf && qf->width >= 0) {
    nn::Features heads_out{qf->width, qf->parts, 1};
    auto takes = o->input_features();
    TORCH_CHECK(!takes || heads_out.matches(*takes), path, ": the heads give ", heads_out.describe(), ", but o_proj (",
                o->type(), ") takes ", takes ? takes->describe() : "");
  }
}

LlamaMlp::LlamaMlp(const LlamaOptions& o) : nn::Unary("LlamaMLP") {
  const int64_t hidden = hidden_of(o);
  set_child("gate_proj", linear(o.dim, hidden));
  set_child("up_proj", linear(o.dim, hidden));
  set_child("down_proj", linear(hidden, o.dim));
}

Tensor LlamaMlp::forward(const Tensor& x) {
  auto h = at::silu(child("gate_proj")->forward({x})) * child("up_proj")->forward({x});
  return child("down_proj")->forward({h});
}

void LlamaMlp::check(const std::string& path) const {
  nn::check_chain({{"gate_proj", child("gate_proj")}, {"down_proj", child("down_proj")}}, path);
  nn::check_chain({{"up_proj", child("up_proj")}, {"down_proj", child("down_proj")}}, path);
}

LlamaBlock::LlamaBlock(const LlamaOptions& o) : nn::Unary("LlamaBlock") {
  set_child("input_layernorm", rms_norm(o));
  set_child("self_attn", std::make_shared<LlamaAttention>(o));
  set_child("post_attention_layernorm", rms_norm(o));
  if (o.experts > 0) set_child("block_sparse_moe", std::make_shared<parallel::MoE>(moe_options(o)));
  else set_child("mlp", std::make_shared<LlamaMlp>(o));
}

const char* LlamaBlock::ffn() const { return child("mlp") ? "mlp" : "block_sparse_moe"; }

Tensor LlamaBlock::forward(const Tensor& x) {
  auto h = x + child("self_attn")->forward({child("input_layernorm")->forward({x})});
  return h + child(ffn())->forward({child("post_attention_layernorm")->forward({h})});
}

void LlamaBlock::check(const std::string& path) const {
  auto in = child("input_layernorm")->input_features();
  const int64_t dim = in ? in->width : -1;
  for (const char* branch : {"self_attn", ffn()}) {
    auto out = child(branch)->output_features();
    TORCH_CHECK(!out || dim < 0 || out->matches(nn::Features{dim}), path, ": ", branch, " gives ", out->describe(),
                ", but the residual stream needs ", nn::Features{dim}.describe());
  }
  nn::check_chain({{"input_layernorm", child("input_layernorm")}, {"self_attn", child("self_attn")}}, path);
  nn::check_chain({{"post_attention_layernorm", child("post_attention_layernorm")}, {ffn(), child(ffn())}}, path);
  if (child("mlp"))
    check_sequence(*this, path, {"input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                 "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                                 "mlp.down_proj"});
  else  // the experts take whole sequences: sequence parallelism stops at them
    check_sequence(*this, path, {"input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                 "self_attn.o_proj", "post_attention_layernorm", "block_sparse_moe"});
}

Llama::Llama(const LlamaOptions& o) : nn::Unary("Llama"), options(o) {
  TORCH_CHECK(o.vocab > 0 && o.seq > 0 && o.dim > 0 && o.heads > 0 && o.layers > 0 && o.kv_heads >= 0 && o.hidden >= 0,
              "llama needs positive sizes: vocab=", o.vocab, " seq=", o.seq, " dim=", o.dim, " heads=", o.heads,
              " layers=", o.layers, " (kv_heads=", o.kv_heads, " and hidden=", o.hidden, " may be 0: the default)");
  TORCH_CHECK(o.layers <= kMaxLayers, "llama: layers must be at most ", kMaxLayers, ", got ", o.layers);
  TORCH_CHECK(o.dim % o.heads == 0, "llama: heads=", o.heads, " does not divide dim=", o.dim);
  TORCH_CHECK(o.heads % kv_heads_of(o) == 0, "llama: kv_heads=", o.kv_heads, " does not divide heads=", o.heads,
              " (each key/value head serves an equal group of query heads)");
  TORCH_CHECK((o.dim / o.heads) % 2 == 0, "llama: the head size dim/heads=", o.dim / o.heads,
              " must be even (rotary embeddings rotate pairs)");
  TORCH_CHECK(o.experts >= 0, "llama: experts must be >= 0 (0: a dense MLP), got ", o.experts);
  if (o.experts > 0) moe_options(o).validate("llama");
  TORCH_CHECK(o.eps > 0 && o.rope_base > 0 && std::isfinite(o.eps) && std::isfinite(o.rope_base),
              "llama: eps and rope_base must be finite numbers > 0, got ", o.eps, " and ", o.rope_base);
  set_child("embed_tokens", std::make_shared<nn::Embedding>(nn::EmbeddingOptions(o.vocab, o.dim)));
  auto layers = std::make_shared<nn::Sequential>();
  for (int64_t i = 0; i < o.layers; ++i) layers->append(std::make_shared<LlamaBlock>(o));
  set_child("layers", layers);
  set_child("norm", rms_norm(o));
  set_child("lm_head", linear(o.dim, o.vocab));
}

bool Llama::check_batch(const Tensor& x, const Tensor& y, const std::string& loss, int64_t ignore_index) {
  return check_lm_batch("Llama", x, y, options.vocab, options.seq, loss, ignore_index, sequence_group(*this));
}

Tensor Llama::embed(const Tensor& ids) {
  // Generating: after the cached positions. Under context parallelism the ids are this rank's
  // rows of a sequence context times as long, which must fit seq (the rotary tables have no bound).
  const auto context = context_group();
  const int64_t first = KvCache::current() ? KvCache::current()->offset
                                           : context ? ids.size(1) * (context->size() - 1) : 0;
  check_token_ids("Llama", ids, options.vocab, options.seq, first, ids.is_cpu());
  return child("embed_tokens")->forward({ids});
}

Tensor Llama::head(const Tensor& x) { return child("lm_head")->forward({child("norm")->forward({x})}); }

Tensor Llama::forward(const Tensor& ids) { return head(child("layers")->forward({embed(ids)})); }

Tensor Llama::stage_in(const Tensor& ids) {
  auto group = sequence_group(*this);
  return group ? parallel::split_sequence(embed(ids), group) : embed(ids);
}

c10::optional<double> Llama::attribute(const std::string& name) const {
  if (name == "seq") return static_cast<double>(options.seq);
  if (name == "tie") return options.tie ? 1 : 0;
  if (name == "context") return context_group() ? context_group()->size() : 1;
  return c10::nullopt;
}

std::vector<nn::ConfigField> Llama::config() const {
  const auto& o = options;
  // heads with kv_heads (heads 4, kv_heads 2 and heads 8, kv_heads 4 give k_proj the same
  // shape), eps and rope_base change the function and no shape; vocab, dim, layers, hidden and
  // tie are pinned by the parameters' shapes and names; seq (rotary: no parameter) and the
  // attention kernel may change when a run resumes.
  std::vector<nn::ConfigField> fields{{"vocab", double(o.vocab)},
          {"seq", double(o.seq)},
          {"dim", double(o.dim)},
          {"heads", double(o.heads), true},
          {"kv_heads", double(kv_heads_of(o)), true},
          {"layers", double(o.layers)},
          {"hidden", double(hidden_of(o))},
          {"eps", o.eps, true},
          {"rope_base", o.rope_base, true},
          {"tie", o.tie ? 1.0 : 0.0},
          {"flash_attention", o.flash_attention ? 1.0 : 0.0}};
  if (o.experts == 0) return fields;
  // experts is pinned by the stacked shapes; top_k and normalize change the function only.
  fields.push_back({"experts", double(o.experts)});
  fields.push_back({"top_k", double(o.top_k), true});
  fields.push_back({"normalize", o.normalize ? 1.0 : 0.0, true});
  fields.push_back({"aux_loss", o.aux_loss});
  fields.push_back({"z_loss", o.z_loss});
  fields.push_back({"capacity_factor", o.capacity_factor});
  return fields;
}

std::string Llama::extra_repr() const {
  std::ostringstream s;
  s << "vocab=" << options.vocab << ", seq=" << options.seq << ", dim=" << options.dim << ", heads=" << options.heads
    << ", kv_heads=" << kv_heads_of(options) << ", layers=" << options.layers << ", hidden=" << hidden_of(options)
    << (options.tie ? ", tied head" : "") << (options.flash_attention ? ", flash_attention" : "");
  if (options.experts > 0) s << ", experts=" << options.experts << ", top_k=" << options.top_k;
  return s.str();
}

void Llama::check(const std::string& path) const {
  check_vocab_head(*this, path, "lm_head");
  nn::check_chain({{"norm", child("norm")}, {"lm_head", child("lm_head")}}, path);
  std::vector<std::string> layers = {"norm", "lm_head"};
  for (const auto& [name, block] : child("layers")->children_named()) layers.push_back("layers." + name + ".input_layernorm");
  check_sequence(*this, path, layers);
  auto split = child("norm")->sequence_split();
  TORCH_CHECK(!(split && *split) || forward_replaced(), path, ": its layers are sequence-parallel, but Llama's own "
              "forward never splits the sequence: replace it (policies/llama.lua does, under sequence_parallel)");
}

bool Llama::init_tensor(const std::string& path, Tensor& t, at::Generator& gen) const {
  auto ends = [&](const std::string& end) {
    return path.size() >= end.size() && path.compare(path.size() - end.size(), end.size(), end) == 0;
  };
  if (path == "norm.weight" || ends("layernorm.weight")) t.fill_(1.0);
  else if (ends(".weight") || ends("experts.w1") || ends("experts.w2") || ends("experts.w3"))
    t.normal_(0, 0.02, gen);  // every projection (stacked experts too), the embedding and an untied head
  else return false;
  return true;
}

nn::ModulePtr llama(const LlamaOptions& o) {
  return nn::build_initialized([&] {
    auto model = std::make_shared<Llama>(o);
    if (o.tie) model->child("lm_head")->set_parameter("weight", model->child("embed_tokens")->param("weight"));
    return nn::ModulePtr(model);
  }, o.dtype);
}

// ---- The family's descriptor ---------------------------------------------------------------

namespace {

// Mixtral's experts: Hugging Face names expert M's matrices apart (experts.M.w1.weight [ffn,
// dim]); partrain stacks them (experts.w1 [E, ffn, dim]). `key` is a name without "model.".
const char kExperts[] = "block_sparse_moe.experts.";

std::optional<HfSlice> mixtral_slice(const std::string& key) {
  const std::string mid = kExperts;
  const auto at = key.rfind(mid);
  if (at == std::string::npos || (at > 0 && key[at - 1] != '.')) return std::nullopt;
  const size_t first = at + mid.size();
  size_t end = first;
  while (end < key.size() && key[end] >= '0' && key[end] <= '9') ++end;
  // M in decimal as Hugging Face writes it: no sign, no leading zero (then one name, one
  // expert), at most 18 digits (an int64).
  if (end == first || end - first > 18 || (key[first] == '0' && end - first > 1)) return std::nullopt;
  const std::string rest = key.substr(end);
  if (rest != ".w1.weight" && rest != ".w2.weight" && rest != ".w3.weight") return std::nullopt;
  return HfSlice{key.substr(0, first) + rest.substr(1, 2), std::stoll(key.substr(first, end - first))};
}

// "layers.N.block_sparse_moe.experts.w1" -> "layers.N.block_sparse_moe.experts.M.w1.weight".
std::optional<std::string> mixtral_slice_name(const std::string& name, int64_t index) {
  const std::string mid = kExperts;
  const auto at = name.rfind(mid);
  if (at == std::string::npos || (at > 0 && name[at - 1] != '.')) return std::nullopt;
  const std::string w = name.substr(at + mid.size());
  if (w != "w1" && w != "w2" && w != "w3") return std::nullopt;
  return name.substr(0, at + mid.size()) + std::to_string(index) + "." + w + ".weight";
}

}  // namespace

Family llama_family() {
  Family f;
  f.name = "llama";
  f.type = "Llama";
  f.default_policy = "policies.llama";
  f.build = [](OptionReader& r) {
    LlamaOptions o;
    o.vocab = r.integer("vocab", o.vocab);
    o.seq = r.integer("seq", o.seq);
    o.dim = r.integer("dim", o.dim);
    o.heads = r.integer("heads", o.heads);
    o.kv_heads = r.integer("kv_heads", o.kv_heads);
    o.layers = r.integer("layers", o.layers);
    o.hidden = r.integer("hidden", o.hidden);
    o.eps = r.number("eps", o.eps);
    o.rope_base = r.number("rope_base", o.rope_base);
    o.tie = r.boolean("tie", o.tie);
    o.flash_attention = r.boolean("flash_attention", o.flash_attention);
    o.experts = r.integer("experts", o.experts);
    o.top_k = r.integer("top_k", o.top_k);
    o.normalize = r.boolean("normalize", o.normalize);
    o.aux_loss = r.number("aux_loss", o.aux_loss);
    o.z_loss = r.number("z_loss", o.z_loss);
    o.capacity_factor = r.number("capacity_factor", o.capacity_factor);
    o.dtype = nn::model_dtype(r.string("dtype", "float32"));
    return llama(o);
  };
  // LlamaForCausalLM's names: "model." before everything but lm_head; no transposes (nn.Linear
  // layers, [out, in] like these). A tied head is stored once, as the embedding.
  // MixtralForCausalLM's experts are stored one tensor an expert: stacked on import, cut on export.
  f.hf.layout = "Hugging Face LLaMA";
  f.hf.from_hf = [](const std::string& hf) { return hf.rfind("model.", 0) == 0 ? hf.substr(6) : hf; };
  f.hf.to_hf = [](const std::string& name) { return name.rfind("lm_head.", 0) == 0 ? name : "model." + name; };
  f.hf.transposed = [](const std::string&) { return false; };
  f.hf.ignored = [](const std::string& hf) {  // older files carry the rotary frequencies partrain computes
    const std::string end = "rotary_emb.inv_freq";
    return hf.size() >= end.size() && hf.compare(hf.size() - end.size(), end.size(), end) == 0;
  };
  f.hf.tied = {{"lm_head.weight", "embed_tokens.weight"}};
  f.hf.sliced = [from = f.hf.from_hf](const std::string& hf) { return mixtral_slice(from(hf)); };
  f.hf.slice_name = [to = f.hf.to_hf](const std::string& name, int64_t index) -> std::optional<std::string> {
    auto slice = mixtral_slice_name(name, index);
    if (!slice) return std::nullopt;
    return to(*slice);
  };
  f.hf.slice_noun = "expert";
  return f;
}

}  // namespace partrain::models

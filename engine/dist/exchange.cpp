// Context parallelism's exchanges (see process_group.hpp): send_recv, a ring step's paired send
// and receive (ring attention), and all_to_all_single, equal slices of dim 0 to every rank
// (DeepSpeed-Ulysses).
#include "engine/dist/c10d_group.hpp"

namespace partrain::dist {

namespace {
// The two halves of a send_recv, launched together on a backend that batches (NCCL): one work
// for both. A failure part way still closes the batch, so the backend's next call starts clean.
c10::intrusive_ptr<c10d::Work> batched(compat::C10dGroup& group, const std::vector<std::function<void()>>& launches) {
  group.startCoalescing();
  try {
    for (const auto& launch : launches) launch();
  } catch (...) {
    try {
      group.endCoalescing();
    } catch (...) {
      // the launch's own error is the one to report
    }
    throw;
  }
  return group.endCoalescing();
}
}  // namespace

Work ProcessGroup::send_recv(const Tensor& out, int dst, Tensor& in, int src, int tag, bool described) const {
  const std::string op = "send_recv";
  check(out, op);
  check(in, op);
  TORCH_CHECK(out.device() == in.device(), op, " on ", describe(), ": the tensor sent is on ", out.device(),
              " and the one received into on ", in.device(), " (both must be on this rank's device)");
  check_peer(dst, "destination", op);
  check_peer(src, "source", op);
  TORCH_CHECK(tag >= 0 && tag < kHeaderTag, op, " on ", describe(), ": tag must be in [0, 2^24), got ", tag);
  if (size() == 1) {  // to itself: what the wire would do, a copy of as many elements of one dtype
    TORCH_CHECK(out.scalar_type() == in.scalar_type() && out.numel() == in.numel(), op, " on ", describe(),
                ": it sends ", out.numel(), " ", dtype_name(out.scalar_type()), " elements to itself; the tensor ",
                "received into holds ", in.numel(), " ", dtype_name(in.scalar_type()));
    in.copy_(out.view(in.sizes()));
    return Work();
  }
  record("send_recv", static_cast<int64_t>(out.nbytes()));
  if (recorded_only()) return Work();
  // Two ledger entries, as a send and a recv would make, so a hang names the half that waits.
  const int64_t sent_ticket = verify(0, op + ": send to group rank " + std::to_string(dst), out, ledger::Op::Send,
                                     /*collective=*/false, 0, 0, dst, tag);
  const int64_t got_ticket = verify(0, op + ": recv from group rank " + std::to_string(src), in, ledger::Op::Recv,
                                    /*collective=*/false, 0, 0, src, tag);
  // Views in Gloo's dtype (nothing to copy back), on the host for Gloo when `in` is on a GPU.
  std::vector<Tensor> wire_out{host_to_send(bytes_for_gloo(out))}, wire_in{host_to_receive(bytes_for_gloo(in))};
  std::vector<Tensor> header_out, header_in;
  if (described) {
    header_out = {header_of(out, out.device())};
    header_in = {torch::zeros({2}, torch::TensorOptions(torch::kInt64).device(in.device()))};
  }
  auto& group = *impl_->group;
  // The received header against `in`, once the data is in; `header_got` (Gloo) is its own work.
  auto compare = [&](c10::intrusive_ptr<c10d::Work> header_got) -> std::function<void()> {
    if (!described) return {};
    return [header_got, header_in, timeout = options_.timeout, dtype = in.scalar_type(), numel = in.numel(),
            what = op + " from group rank " + std::to_string(src) + " on " + describe()] {
      if (header_got) wait_for(*header_got, timeout);
      check_header(header_in[0], dtype, numel, what);
    };
  };
  if (!group.supportsCoalescing()) {
    // Gloo: an async send and an async receive, each on its channel; the headers beside them.
    // The receive is waited for first, then the send, then the header is compared.
    c10::intrusive_ptr<c10d::Work> header_sent, header_got;
    Work sent = run(
        op,
        [&] {
          if (described) header_sent = group.send(header_out, dst, kHeaderTag + tag);
          return group.send(wire_out, dst, tag);
        },
        /*async=*/true, {}, sent_ticket);
    Work got = run(
        op,
        [&] {
          if (described) header_got = group.recv(header_in, src, kHeaderTag + tag);
          return group.recv(wire_in, src, tag);
        },
        /*async=*/true, {}, got_ticket);
    if (header_sent)
      sent.after_ = [header_sent, header_out, timeout = options_.timeout] { wait_for(*header_sent, timeout); };
    got.after_ = compare(header_got);
    if (stages_on_host(in)) {  // staged on the host: into `in` once it has arrived
      got.after_ = [checked = std::move(got.after_), host = wire_in[0], into = bytes_for_gloo(in)]() mutable {
        if (checked) checked();
        into.copy_(host);
      };
    }
    got.also_ = std::make_shared<Work>(std::move(sent));
    return got;
  }
  // NCCL: one batch (ncclGroupStart ... ncclGroupEnd), so neither half waits for the other to be
  // posted; the headers travel in it, ahead of the data, in the same order on both sides.
  std::vector<std::function<void()>> launches;
  if (described) {
    launches.push_back([&] { group.send(header_out, dst, kHeaderTag + tag); });
    launches.push_back([&] { group.recv(header_in, src, kHeaderTag + tag); });
  }
  launches.push_back([&] { group.send(wire_out, dst, tag); });
  launches.push_back([&] { group.recv(wire_in, src, tag); });
  c10::intrusive_ptr<c10d::Work> both;
  try {
    started_ += 2;
    both = batched(group, launches);
  } catch (const std::exception& e) {
    ledger_set(sent_ticket, ledger::State::Failed);
    ledger_set(got_ticket, ledger::State::Failed);
    fail(op, util::message_of(e));
  }
  Work got = start(op, both, compare(nullptr), got_ticket);
  // The send's entry on the same work (done with it); the header sent kept alive until then.
  got.also_ = std::make_shared<Work>(start(op, both, [header_out] {}, sent_ticket));
  return got;
}

Work ProcessGroup::all_to_all_single(Tensor& out, const Tensor& in, bool async) const {
  const std::string op = "all_to_all";
  check(in, op);
  TORCH_CHECK(in.dim() >= 1 && in.size(0) % size() == 0, op, " on ", describe(), ": needs a tensor whose dim 0 is ",
              "a multiple of ", size(), " (one slice a rank), got shape ", in.sizes());
  if (!out.defined()) out = torch::empty_like(in, torch::MemoryFormat::Contiguous);
  check(out, op);
  TORCH_CHECK(out.sizes().equals(in.sizes()) && out.scalar_type() == in.scalar_type() && out.device() == in.device(),
              op, " on ", describe(), ": the output must have the input's shape ", in.sizes(), ", dtype ",
              dtype_name(in.scalar_type()), " and device ", in.device(), ", got ", out.sizes(), " ",
              dtype_name(out.scalar_type()), " on ", out.device());
  TORCH_CHECK(in.numel() == 0 || !out.is_alias_of(in), op, " on ", describe(),
              ": the output must not share the input's memory");
  const int64_t ticket = verify(12, op, in, ledger::Op::AllToAll);
  if (recorded_only()) record("all_to_all", static_cast<int64_t>(in.nbytes()));
  if (!impl_) {
    if (!recorded_only()) out.copy_(in);
    return Work();
  }
  record("all_to_all", static_cast<int64_t>(in.nbytes()));
  if (in.numel() == 0) {  // nothing moves (Gloo divides by the bytes each rank gives)
    ledger_set(ticket, ledger::State::Completed);
    return Work();
  }
  auto wire_out = bytes_for_gloo(out), wire_in = bytes_for_gloo(in);
  std::vector<int64_t> equal;  // empty split lists: equal slices of dim 0
  c10d::AllToAllOptions o;
  o.timeout = options_.timeout;
  return run(op, [&] { return impl_->group->alltoall_base(wire_out, wire_in, equal, equal, o); }, async, {}, ticket);
}

Work ProcessGroup::all_to_all_single(Tensor& out, const Tensor& in, const std::vector<int64_t>& out_splits,
                                     const std::vector<int64_t>& in_splits, bool async) const {
  const std::string op = "all_to_all";
  check(in, op);
  TORCH_CHECK(in.dim() >= 1, op, " on ", describe(), ": needs rows (a tensor of at least one dimension), got a scalar");
  auto total = [&](const std::vector<int64_t>& splits, const char* which) {
    TORCH_CHECK(static_cast<int>(splits.size()) == size(), op, " on ", describe(), ": ", which, " needs one count a rank (",
                size(), "), got ", splits.size());
    int64_t sum = 0;
    for (auto n : splits) {
      TORCH_CHECK(n >= 0, op, " on ", describe(), ": ", which, " holds a negative count ", n);
      sum += n;
    }
    return sum;
  };
  const int64_t sent = total(in_splits, "in_splits"), arriving = total(out_splits, "out_splits");
  TORCH_CHECK(sent == in.size(0), op, " on ", describe(), ": in_splits sum to ", sent, " rows, but the tensor has ",
              in.size(0));
  auto shape = in.sizes().vec();
  shape[0] = arriving;
  if (!out.defined()) out = torch::empty(shape, in.options().memory_format(torch::MemoryFormat::Contiguous));
  check(out, op);
  TORCH_CHECK(out.sizes().vec() == shape && out.scalar_type() == in.scalar_type() && out.device() == in.device(), op,
              " on ", describe(), ": the output must have shape ", c10::IntArrayRef(shape), ", dtype ",
              dtype_name(in.scalar_type()), " and device ", in.device(), ", got ", out.sizes(), " ",
              dtype_name(out.scalar_type()), " on ", out.device());
  TORCH_CHECK(out.numel() == 0 || in.numel() == 0 || !out.is_alias_of(in), op, " on ", describe(),
              ": the output must not share the input's memory");
  // Checked on the trailing shape: every rank's row count differs by design.
  const int64_t ticket = verify(13, op + " (rows)", in.narrow(0, 0, 0), ledger::Op::AllToAll);
  if (recorded_only()) {
    record("all_to_all", static_cast<int64_t>(in.nbytes()));
    return Work();
  }
  if (!impl_) {
    TORCH_CHECK(out_splits[0] == in_splits[0], op, " on ", describe(), ": it sends ", in_splits[0],
                " rows to itself but expects ", out_splits[0]);
    out.copy_(in);
    return Work();
  }
  record("all_to_all", static_cast<int64_t>(in.nbytes()));
  // No early return for empty tensors: a rank that sends nothing may still receive.
  auto wire_out = bytes_for_gloo(out), wire_in = bytes_for_gloo(in);
  auto outs = out_splits, ins = in_splits;
  c10d::AllToAllOptions o;
  o.timeout = options_.timeout;
  return run(op, [&] { return impl_->group->alltoall_base(wire_out, wire_in, outs, ins, o); }, async, {}, ticket);
}

Tensor ProcessGroup::all_to_all_rows(const Tensor& in, const std::vector<int64_t>& in_splits,
                                     std::vector<int64_t>* out_splits) const {
  TORCH_CHECK(static_cast<int>(in_splits.size()) == size(), "all_to_all on ", describe(),
              ": in_splits needs one count a rank (", size(), "), got ", in_splits.size());
  auto counts = torch::tensor(in_splits, torch::TensorOptions(torch::kInt64)).to(in.device());
  Tensor arrived;
  all_to_all_single(arrived, counts);
  auto host = arrived.cpu();
  std::vector<int64_t> splits(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + host.numel());
  Tensor out;
  all_to_all_single(out, in, splits, in_splits);
  if (out_splits) *out_splits = std::move(splits);
  return out;
}

}  // namespace partrain::dist

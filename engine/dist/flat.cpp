// ZeRO's flat collectives: a flat tensor's equal parts reduce-scattered to the group's ranks and
// all-gathered back, on Gloo by a ring of sends and receives (or one all-to-all), on NCCL natively.
#include "engine/dist/c10d_group.hpp"

namespace partrain::dist {

namespace {
// The channel the rings' sends use, apart from any tag a caller gives its own point-to-point.
constexpr int kRingTag = ledger::kRingTag;

// acc = op(acc, other), in place, for a ring step's partial reduction (Mean sums, divided at the end).
void combine(Tensor& acc, const Tensor& other, ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Mean: acc.add_(other); break;
    case ReduceOp::Min: torch::minimum_out(acc, acc, other); break;
    case ReduceOp::Max: torch::maximum_out(acc, acc, other); break;
    case ReduceOp::Product: acc.mul_(other); break;
  }
}
}  // namespace

int64_t ProcessGroup::flat_part(const Tensor& flat, const std::string& op) const {
  check(flat, op);
  TORCH_CHECK(flat.dim() == 1 && flat.numel() % size() == 0, op, " on ", describe(), ": needs a flat tensor whose ",
              "length is a multiple of ", size(), ", got shape ", flat.sizes());
  return flat.numel() / size();
}

Tensor ProcessGroup::reduce_scatter_flat(Tensor& flat, ReduceOp op) const {
  const int64_t part = flat_part(flat, "reduce_scatter");
  const int p = size();
  auto part_of = [&](int r) { return flat.narrow(0, ((r % p) + p) % p * part, part); };
  Tensor mine = part_of(rank_);
  if (p == 1) return mine;
  if (!needs_inbox() && impl_) {  // NCCL: its own, waited for here
    Tensor none;
    start_reduce_scatter_flat(flat, op, none).wait();
    return mine;
  }
  const int64_t ticket =
      verify(9, "reduce_scatter(" + to_string(op) + ")", flat, ledger::Op::ReduceScatter, true, 0, 1 + static_cast<int>(op));
  // The ring: at step s rank r sends part r-s-1 to r+1 and combines part r-s-2 from r-1 into its
  // own copy; after p-1 steps part r has passed through every rank and ends on rank r. The ledger
  // has the reduce-scatter and each step's send and receive.
  const int next = (rank_ + 1) % p, prev = (rank_ + p - 1) % p;
  Tensor incoming = torch::empty_like(mine);
  try {
    for (int s = 0; s < p - 1; ++s) {
      Work sent = send(part_of(rank_ - s - 1), next, /*async=*/true, kRingTag);
      recv(incoming, prev, /*async=*/false, kRingTag);
      auto acc = part_of(rank_ - s - 2);
      combine(acc, incoming, op);
      sent.wait();
    }
  } catch (...) {
    ledger_set(ticket, ledger::State::Failed);
    throw;
  }
  ledger_set(ticket, ledger::State::Completed);
  if (op == ReduceOp::Mean) mine.div_(p);
  return mine;
}

Work ProcessGroup::start_reduce_scatter_flat(Tensor& flat, ReduceOp op, Tensor& inbox) const {
  const int64_t part = flat_part(flat, "reduce_scatter");
  const int p = size();
  TORCH_CHECK(!needs_inbox() || (inbox.defined() && inbox.is_contiguous() && inbox.sizes().equals(flat.sizes()) &&
                                  inbox.scalar_type() == flat.scalar_type() && inbox.device() == flat.device()),
              "reduce_scatter on ", describe(), ": the inbox must be a contiguous tensor of the flat tensor's shape ",
              flat.sizes(), ", dtype and device");
  Tensor mine = flat.narrow(0, rank_ * part, part);
  if (p == 1) return Work();
  // Agreed on, and in the ledger, as the ring's reduce-scatter is: the same call.
  const int64_t ticket =
      verify(9, "reduce_scatter(" + to_string(op) + ")", flat, ledger::Op::ReduceScatter, true, 0, 1 + static_cast<int>(op));
  if (recorded_only()) record("reduce_scatter", static_cast<int64_t>(flat.nbytes()));
  if (!impl_) return Work();
  record("reduce_scatter", static_cast<int64_t>(flat.nbytes()));  // as the blocking one records it
  const std::string name = "reduce_scatter(" + to_string(op) + ")";
  if (!needs_inbox()) {  // NCCL
    std::vector<Tensor> out{torch::empty_like(mine)};
    std::vector<std::vector<Tensor>> in{flat.chunk(p)};
    c10d::ReduceScatterOptions o;
    o.reduceOp = c10d_op(op == ReduceOp::Mean ? ReduceOp::Sum : op);
    o.timeout = options_.timeout;
    return run(name, [&] { return impl_->group->reduce_scatter(out, in, o); }, /*async=*/true,
               [mine, got = out[0], op, p]() mutable {
                 mine.copy_(got);
                 if (op == ReduceOp::Mean) mine.div_(p);
               },
               ticket);
  }
  std::vector<int64_t> equal;  // equal splits: part j of `flat` goes to rank j
  c10d::AllToAllOptions o;
  o.timeout = options_.timeout;
  auto wire_in = bytes_for_gloo(flat), wire_out = bytes_for_gloo(inbox);
  return run(name, [&] { return impl_->group->alltoall_base(wire_out, wire_in, equal, equal, o); }, /*async=*/true,
             [mine, inbox, op, p, part]() mutable {
               // Every rank's part r, combined in group-rank order (the same order on every rank).
               mine.copy_(inbox.narrow(0, 0, part));
               for (int j = 1; j < p; ++j) combine(mine, inbox.narrow(0, j * part, part), op);
               if (op == ReduceOp::Mean) mine.div_(p);
             },
             ticket);
}

void ProcessGroup::all_gather_flat(Tensor& flat) const {
  const int64_t part = flat_part(flat, "all_gather");
  const int p = size();
  if (p == 1) return;
  auto part_of = [&](int r) { return flat.narrow(0, ((r % p) + p) % p * part, part); };
  const int64_t ticket = verify(10, "all_gather(flat)", flat, ledger::Op::AllGather);
  if (options_.backend == "nccl" && impl_) {
    record("all_gather", static_cast<int64_t>(flat.nbytes()));
    std::vector<std::vector<Tensor>> out{flat.chunk(p)};
    std::vector<Tensor> in{part_of(rank_).clone()};
    run("all_gather", [&] { return impl_->group->allgather(out, in); }, /*async=*/false, {}, ticket);
    return;
  }
  // The ring: at step s rank r passes on part r-s (its own first, then the one it just got).
  const int next = (rank_ + 1) % p, prev = (rank_ + p - 1) % p;
  try {
    for (int s = 0; s < p - 1; ++s) {
      Work sent = send(part_of(rank_ - s), next, /*async=*/true, kRingTag);
      Tensor into = part_of(rank_ - s - 1);
      recv(into, prev, /*async=*/false, kRingTag);
      sent.wait();
    }
  } catch (...) {
    ledger_set(ticket, ledger::State::Failed);
    throw;
  }
  ledger_set(ticket, ledger::State::Completed);
}

Work ProcessGroup::start_all_gather_flat(Tensor& flat, const Tensor& mine) const {
  const int64_t part = flat_part(flat, "all_gather");
  TORCH_CHECK(flat.is_contiguous() && mine.is_contiguous() && mine.numel() == part &&
                  mine.scalar_type() == flat.scalar_type() && mine.device() == flat.device(),
              "all_gather on ", describe(), ": the part must be a contiguous tensor of ", part,
              " elements of the flat tensor's dtype and device, got shape ", mine.sizes());
  const int64_t ticket = verify(10, "all_gather(flat)", flat, ledger::Op::AllGather);
  if (recorded_only()) record("all_gather", static_cast<int64_t>(flat.nbytes()));
  if (size() == 1 || !impl_) {
    if (!recorded_only()) flat.copy_(mine);
    return Work();
  }
  record("all_gather", static_cast<int64_t>(flat.nbytes()));
  auto wire_out = bytes_for_gloo(flat), wire_in = bytes_for_gloo(mine);
  c10d::AllgatherOptions o;
  o.timeout = options_.timeout;
  return run("all_gather", [&] { return impl_->group->_allgather_base(wire_out, wire_in, o); }, /*async=*/true, {},
             ticket);
}

}  // namespace partrain::dist

// bindings/torch/csrc/layer_impl.hpp: the torch layers' construction, dispatch and combine
// (basic_torch_layer of layer.hpp), instantiated by layer.cpp (host and emulated device)
// and layer_cuda.cu (CUDA).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>

#include "layer.hpp"

namespace epx_torch {

namespace layer_detail {

using epx::detail::concat;

inline const char* dtype_name(dtype_code d) {
  switch (d) {
    case dtype_code::float32: return "torch.float32";
    case dtype_code::float64: return "torch.float64";
    case dtype_code::bfloat16: return "torch.bfloat16";
    case dtype_code::float16: return "torch.float16";
  }
  return "?";
}

inline std::string shape_of(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += concat(d ? ", " : "", t.size(d));
  return s + "]";
}

// The layer's own checks on this rank, as a sentence ("" when fine), as moe_layer makes them.
template <class Comm>
std::string local_check(const epx::mesh& m, int world_size, const epx::layer_options& o, path_kind path,
                        std::size_t elem_bytes) {
  try {
    m.validate_world(world_size);
    m.validate_top_k(o.top_k);
    EPX_REQUIRE(o.hidden >= 1, epx::errc::configuration, "hidden (", o.hidden, ") must be at least 1");
    EPX_REQUIRE(o.hidden <= epx::detail::max_buffer_bytes / elem_bytes, epx::errc::configuration, "hidden (",
                o.hidden, ") is too large: a row of hidden * ", elem_bytes, " bytes must stay within ",
                epx::detail::max_buffer_bytes, " bytes");
    o.pad.validate();
    if (path == path_kind::all_reduce) return epx::detail::all_reduce_impl<Comm>::can_implement(m, o);
    return {};
  } catch (const epx::error& e) {
    return e.message();
  }
}

// A communicator over the group `name`: the host one, or a device one whose waits end after
// timeout_s.
template <class Comm>
std::unique_ptr<Comm> make_comm(const std::string& name, int world_rank, int world_size, double timeout_s) {
  if constexpr (std::is_same_v<Comm, torch_communicator>) {
    (void)timeout_s;
    return std::make_unique<Comm>(name, world_rank, world_size);
  } else {
    const auto ms = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000.0));
    return std::make_unique<Comm>(name, world_rank, world_size, ms);
  }
}

// Steps 1-2 of dispatch on either path: the send plan of `n` pairs (queued on the policy),
// this rank's record of the count exchange built from it where it lives, and the exchange
// (the call's one read-back: bad input on any rank raises on every rank here). Then the
// plan's host counts (this rank's own record) and its scatter (pos, src_row).
template <class Exec>
struct planned {
  epx::layout::send_plan<Exec> plan;
  epx::detail::group_records records;  // every rank's record: records.counts(r)[E]
};

template <class Exec, class Comm>
planned<Exec> plan_and_exchange(const Exec& ex, Comm& comm, const std::int32_t* ids,
                                               const float* weights, std::size_t n, std::size_t row0, int k, int E,
                                               std::size_t chunks, bool ok, const std::string& why, std::size_t N,
                                               std::size_t H, int world_rank, int agree_rows, bool training) {
  using namespace epx::detail;
  planned<Exec> out{epx::layout::launch_plan_counts(ex, ids, weights, n, k, E, chunks), {}};
  auto& plan = out.plan;
  const auto Es = static_cast<std::size_t>(E);
  const std::size_t stride = record_header + Es;
  auto record = epx::exec::make_buffer<std::int64_t>(ex, stride);
  epx::exec::for_each_n(ex, stride,
                        plan_record{ok ? 0 : 1, static_cast<std::int64_t>(N), static_cast<std::int64_t>(H), k,
                                    world_rank, plan.chunk_bad(), plan.chunks, plan.expert_counts(), Es, nullptr, 0,
                                    record.data(), training ? epx::detail::record_training : epx::detail::record_inference});
  const auto message = [&]() -> std::string {
    if (!ok) return why;
    return epx::layout::describe(epx::layout::find_bad_pair(ex, plan, ids, weights), k, E, row0);
  };
  out.records = exchange_policy_records(comm, ex, static_cast<const std::int64_t*>(record.data()), stride, message,
                                        "epx_torch dispatch", agree_rows);
  epx::layout::set_host_counts(plan, out.records.counts(comm.rank()));
  epx::layout::launch_scatter(ex, plan, ids, weights);
  return out;
}

}  // namespace layer_detail

template <class Exec, class Comm>
basic_torch_layer<Exec, Comm>::basic_torch_layer(const epx::mesh_config& mc, const std::string& world_group,
                                                 int world_rank, int world_size, std::size_t hidden, int top_k,
                                                 int pad_rows, int pad_align, int dtype, int path, int transport,
                                                 double timeout_s)
    : dtype_(static_cast<dtype_code>(dtype)), path_(static_cast<path_kind>(path)), world_rank_(world_rank) {
  using namespace layer_detail;
  world_ = make_comm<Comm>(world_group, world_rank, world_size, timeout_s);
  options_.hidden = hidden;
  options_.top_k = top_k;
  options_.pad.rows_per_expert = pad_rows;
  options_.pad.align = pad_align;
  // A mesh that fails its own rules on this rank still joins the agreement (with a
  // one-rank mesh in its record), so that every rank raises instead of waiting.
  std::string why;
  try {
    mesh_ = std::make_unique<epx::mesh>(mc);
  } catch (const epx::error& e) {
    why = e.message();
    mesh_ = std::make_unique<epx::mesh>(epx::mesh_config{});
  }
  if (why.empty())
    why = local_check<Comm>(*mesh_, world_->size(), options_, path_, c10::elementSize(scalar_type_of(dtype_)));
  epx::detail::agree_on_layer(*world_, *mesh_, options_, world_rank, "world", why);
  // The fields moe_layer's record does not have: the element type, the path, the transport.
  const std::int64_t mine[4] = {world_rank, dtype, path, transport};
  std::vector<std::int64_t> all(4 * static_cast<std::size_t>(world_->size()));
  epx::detail::all_gather_host(*world_, mine, 4, all.data());
  // As Python spells them (epx_torch's _PATHS and _TRANSPORTS).
  const auto path_name = [](std::int64_t v) {
    return v == 0 ? "'all_to_all'" : v == 1 ? "'all_reduce'" : v == 2 ? "'auto'" : "unknown";
  };
  const auto transport_name = [](std::int64_t v) {
    return v == 0 ? "'auto'" : v == 1 ? "'shm'" : v == 2 ? "'group'" : "unknown";
  };
  std::string differ;
  for (int r = 1; r < world_->size(); ++r) {
    const auto* rec = all.data() + 4 * static_cast<std::size_t>(r);
    if (rec[1] != all[1])
      differ += concat("; rank ", rec[0], " has dtype=", dtype_name(static_cast<dtype_code>(rec[1])), " but rank ",
                       all[0], " has dtype=", dtype_name(static_cast<dtype_code>(all[1])));
    if (rec[2] != all[2])
      differ += concat("; rank ", rec[0], " has path=", path_name(rec[2]), " but rank ", all[0], " has path=",
                       path_name(all[2]));
    if (rec[3] != all[3])
      differ += concat("; rank ", rec[0], " has transport=", transport_name(rec[3]), " but rank ", all[0],
                       " has transport=", transport_name(all[3]));
  }
  EPX_REQUIRE(differ.empty(), epx::errc::configuration,
              "epx_torch layer: the ranks of the world process group built different layers", differ);
  ep_ = std::make_unique<Comm>(epx::sub_communicator(*world_, *mesh_, epx::group_kind::ep));
  tp_ = std::make_unique<Comm>(epx::sub_communicator(*world_, *mesh_, epx::group_kind::tp));
  efsdp_ = std::make_unique<Comm>(epx::sub_communicator(*world_, *mesh_, epx::group_kind::efsdp));
  fsdp_ = std::make_unique<Comm>(epx::sub_communicator(*world_, *mesh_, epx::group_kind::fsdp));
  dp_replicate_ = std::make_unique<Comm>(epx::sub_communicator(*world_, *mesh_, epx::group_kind::dp_replicate));
  // The rows of dispatch and combine move inside the EP group, the TP sums inside the TP group.
  if constexpr (std::is_same_v<Comm, torch_communicator>) {
    if (transport != 2) {
      ep_->enable_shared_memory(timeout_s, transport == 1);
      if (mesh_->tp() > 1) tp_->enable_shared_memory(timeout_s, transport == 1);
    }
  }
}

template <class Exec, class Comm>
std::string basic_torch_layer<Exec, Comm>::check_tensor(const char* what, const at::Tensor& t, at::ScalarType want, std::int64_t rows,
                                      std::int64_t cols) const {
  using layer_detail::concat;
  using layer_detail::shape_of;
  if (!t.defined()) return concat(what, " is None");
  if (t.device() != device())
    return concat(what, " is on device ", t.device().str(), ", but this layer runs on ", device().str());
  if (t.scalar_type() != want)
    return concat(what, " has dtype ", c10::toString(t.scalar_type()), " but must be ", c10::toString(want));
  if (t.dim() != 2 || (rows >= 0 && t.size(0) != rows) || t.size(1) != cols)
    return concat(what, " has shape ", shape_of(t), " but must be [", rows >= 0 ? std::to_string(rows) : "N", ", ",
                  cols, "]");
  return {};
}

template <class Exec, class Comm>
std::tuple<at::Tensor, at::Tensor, std::shared_ptr<dispatch_state>> basic_torch_layer<Exec, Comm>::dispatch(
    const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, bool training, bool masked,
    const std::string& not_tensors) {
  const typename layer_side<Exec>::guard on_device(device_);
  const auto H = static_cast<std::int64_t>(options_.hidden);
  const auto k = static_cast<std::int64_t>(options_.top_k);
  std::string why = not_tensors;
  if (why.empty()) why = check_tensor("x", x, scalar_type_of(dtype_), -1, H);
  const std::int64_t N = x.defined() && x.dim() == 2 ? x.size(0) : 0;
  // The wrapper converts int64, int16, int8 and uint8 ids to int32 (epx_torch._ids32): any
  // other dtype here is not one the call takes.
  if (why.empty() && ids.defined() && ids.device() == device() && ids.scalar_type() != at::kInt)
    why = layer_detail::concat("expert ids has dtype ", c10::toString(ids.scalar_type()),
                               " but must be an integer type (int64, int32, int16, int8 or uint8)");
  if (why.empty()) why = check_tensor("expert ids", ids, at::kInt, N, k);
  if (why.empty()) why = check_tensor("routing weights", weights, at::kFloat, N, k);
  return with_type(dtype_, [&](auto t) {
    return dispatch_t<decltype(t)>(why.empty() ? x.contiguous() : x, why.empty() ? ids.contiguous() : ids,
                                   why.empty() ? weights.contiguous() : weights, training, masked, why);
  });
}

template <class Exec, class Comm>
template <class T>
std::tuple<at::Tensor, at::Tensor, std::shared_ptr<dispatch_state>> basic_torch_layer<Exec, Comm>::dispatch_t(
    const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights, bool training, bool masked,
    const std::string& why) {
  const auto ex = exec();
  const epx::mesh& m = *mesh_;
  const int E = m.experts(), L = m.local_experts(), tp = m.tp(), ep = m.ep(), me = m.ep_rank(world_rank_);
  const std::size_t H = options_.hidden;
  const int k = options_.top_k;
  const auto ks = static_cast<std::size_t>(k);
  const bool ok = why.empty();
  const std::size_t N = x.defined() && x.dim() == 2 ? static_cast<std::size_t>(x.size(0)) : 0;
  auto s = std::make_shared<dispatch_state>();
  s->masked = masked;
  s->training = training;
  s->rows = N;
  s->hidden = H;
  s->top_k = k;
  const std::int32_t* id = ok ? ptr<const std::int32_t>(ids) : nullptr;
  const float* w = ok ? ptr<const float>(weights) : nullptr;
  const T* xp = ok ? ptr<const T>(x) : nullptr;

  if (!masked) {
    // 1. This TP rank's slice and its send plan; 2. the count exchange, which raises on
    // every rank when any rank's input is bad; 3. the receive layout.
    const epx::row_slice sl = ok ? epx::slice_bounds(N, tp, m.coords(world_rank_).tp) : epx::row_slice{};
    const std::size_t n = sl.size();
    auto [plan, records] = layer_detail::plan_and_exchange(ex, *ep_, ok ? id + sl.begin * ks : nullptr,
                                                           ok ? w + sl.begin * ks : nullptr, ok ? n : 0, sl.begin, k,
                                                           E, options_.chunks, ok, why, N, H, world_rank_, tp,
                                                           s->training);
    s->layout = epx::detail::make_receive_layout(ep, ep, L, options_.pad, [&](int r) { return records.counts(r); });
    // The same layout on every rank: a buffer of rows * H that would wrap raises on all of them.
    epx::detail::check_buffer_rows(s->layout, H, sizeof(T), "epx_torch dispatch");
    s->slice = sl;
    const std::size_t S = n * ks, R = s->layout.rows(me);
    s->expert_rows = R;
    s->seg = epx::detail::segments_of(s->layout, me);
    // 4. Rows into send order, then the segmented all-to-all lands them expert-major.
    const at::ScalarType st = scalar_type_of(dtype_);
    at::Tensor send;
    T* sp = send_buffer<T>(S, tensor_pool::send, send);
    at::Tensor recv = pool_.get(tensor_pool::rows, static_cast<std::int64_t>(R), static_cast<std::int64_t>(H), st);
    epx::kernels::gather(ex, S, H, xp + sl.begin * H, static_cast<const std::int64_t*>(plan.src_row.data()), sp);
    epx::detail::zero_padding(ex, ptr<T>(recv), s->layout, me, H);
    epx::all_to_allv_segments(*ep_, static_cast<const T*>(sp), epx::make_span(s->seg.send_counts),
                              epx::make_span(s->seg.send_displs), ptr<T>(recv), epx::make_span(s->seg.recv_counts),
                              epx::make_span(s->seg.recv_displs), static_cast<std::size_t>(L), H);
    s->weights_at = pool_.get(tensor_pool::weights, 1, static_cast<std::int64_t>(S), at::kFloat)[0];  // per send position
    epx::kernels::scatter(ex, S, static_cast<const std::int64_t*>(plan.pos.data()), w + sl.begin * ks,
                          ptr<float>(s->weights_at));
    s->pos = adopt(std::move(plan.pos), S);
    s->src_row = adopt(std::move(plan.src_row), S);
    const std::size_t* off = s->layout.offsets(me);
    s->offsets.assign(off, off + L + 1);
    return {recv, offsets_tensor(off, L), s};
  }

  // The masked path: every rank of the EP group holds the same rows; this rank keeps the
  // pairs of its own experts (epx/impl/all_reduce.hpp).
  const std::size_t Nr = ok ? N : 0;
  const int first = m.expert_begin(world_rank_);
  auto plan = layer_detail::plan_and_exchange(ex, *ep_, ok ? id : nullptr, ok ? w : nullptr, Nr, 0, k, E,
                                              options_.chunks, ok, why, N, H, world_rank_, ep, s->training)
                  .plan;
  s->layout = epx::detail::make_receive_layout(1, ep, L, options_.pad, [&](int) { return plan.host_counts.data(); });
  epx::detail::check_buffer_rows(s->layout, H, sizeof(T), "epx_torch dispatch");
  const std::size_t* off = s->layout.offsets(me);
  s->offsets.assign(off, off + L + 1);
  std::vector<std::int64_t> off64(s->offsets.begin(), s->offsets.end());
  const std::size_t R = s->offsets.back();
  s->expert_rows = R;
  auto local_offset = epx::exec::make_buffer<std::int64_t>(ex, static_cast<std::size_t>(L) + 1);
  auto row_source = epx::exec::make_buffer<std::int64_t>(ex, R);
  auto pos = epx::exec::make_buffer<std::int64_t>(ex, Nr * ks);
  // Queued, no wait (from pageable memory a device copy has read it when it returns).
  epx::exec::copy_n(ex, static_cast<const std::int64_t*>(off64.data()), off64.size(), local_offset.data());
  epx::exec::for_each_n(ex, R,
                        epx::layout::masked_source_rows{plan.src_row.data(), plan.expert_offset(),
                                                        local_offset.data(), row_source.data(), first, L});
  epx::exec::for_each_n(ex, Nr * ks,
                        epx::layout::masked_positions{id, plan.pos.data(), plan.expert_offset(),
                                                      local_offset.data(), pos.data(), first, L});
  at::Tensor local = pool_.get(tensor_pool::rows, static_cast<std::int64_t>(R), static_cast<std::int64_t>(H),
                               scalar_type_of(dtype_));
  epx::kernels::gather(ex, R, H, xp, static_cast<const std::int64_t*>(row_source.data()), ptr<T>(local));
  s->weights_at = pool_.get(tensor_pool::weights, 1, static_cast<std::int64_t>(R), at::kFloat)[0];  // per local row
  epx::exec::fill_zero(ex, ptr<float>(s->weights_at), R);
  epx::kernels::scatter(ex, Nr * ks, static_cast<const std::int64_t*>(pos.data()), w, ptr<float>(s->weights_at));
  s->row_source = adopt(std::move(row_source), R);
  s->pos = adopt(std::move(pos), Nr * ks);
  s->slice = epx::row_slice{0, Nr};
  return {local, offsets_tensor(off, L), s};
}

template <class Exec, class Comm>
at::Tensor basic_torch_layer<Exec, Comm>::offsets_tensor(const std::size_t* off, int L) {
  const auto n = static_cast<std::size_t>(L) + 1;
  const bool on_cpu = device().is_cpu();
  // On a GPU: through a pinned buffer kept by the layer, copied without a host wait (a
  // pageable copy would wait for the stream, where the all-to-all is queued by now). The
  // buffer is written again only after the next call's count exchange, which waits for the
  // stream, so the copy has read it by then.
  if (!on_cpu && (!pinned_.defined() || pinned_.numel() < static_cast<std::int64_t>(n)))
    pinned_ = at::empty({static_cast<std::int64_t>(n)}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  at::Tensor o = on_cpu ? at::empty({static_cast<std::int64_t>(n)}, at::kLong) : pinned_.narrow(0, 0, n);
  for (std::size_t l = 0; l < n; ++l) ptr<std::int64_t>(o)[l] = static_cast<std::int64_t>(off[l]);
  return on_cpu ? o : o.to(device(), /*non_blocking=*/true);
}

template <class Exec, class Comm>
template <class T>
T* basic_torch_layer<Exec, Comm>::send_buffer(std::size_t S, int slot, at::Tensor& keep) {
  const std::size_t H = options_.hidden;
  if constexpr (std::is_same_v<Comm, torch_communicator>) {
    // With shared memory the rows are gathered straight into the exchange's buffer.
    if (void* p = ep_->outbox(S * H * sizeof(T), static_cast<std::size_t>(mesh_->local_experts())))
      return static_cast<T*>(p);
  }
  keep = pool_.get(slot, static_cast<std::int64_t>(S), static_cast<std::int64_t>(H), scalar_type_of(dtype_));
  return ptr<T>(keep);
}

template <class Exec, class Comm>
template <class B>
at::Tensor basic_torch_layer<Exec, Comm>::adopt(B&& b, std::size_t n) const {
  const auto opt = at::TensorOptions().dtype(at::kLong).device(device());
  if (n == 0) return at::empty({0}, opt);
  auto keep = std::make_shared<std::decay_t<B>>(std::move(b));
  return at::from_blob(static_cast<void*>(keep->data()), {static_cast<std::int64_t>(n)}, [keep](void*) {}, opt);
}

template <class Exec, class Comm>
at::Tensor basic_torch_layer<Exec, Comm>::combine(const std::shared_ptr<dispatch_state>& s,
                                                  const at::Tensor& expert_out, const at::Tensor& weights,
                                                  bool keep, const std::string& not_tensors) {
  EPX_REQUIRE(s != nullptr, epx::errc::input, "combine needs the handle of a dispatch");
  const typename layer_side<Exec>::guard on_device(device_);
  return with_type(dtype_,
                   [&](auto t) { return combine_t<decltype(t)>(*s, expert_out, weights, keep, not_tensors); });
}

template <class Exec, class Comm>
template <class T>
at::Tensor basic_torch_layer<Exec, Comm>::combine_t(dispatch_state& s, const at::Tensor& y_in, const at::Tensor& weights,
                                                    bool keep, const std::string& not_tensors) {
  const auto ex = exec();
  const epx::mesh& m = *mesh_;
  const int tp = m.tp();
  const std::size_t H = s.hidden, N = s.rows, R = s.expert_rows;
  const auto ks = static_cast<std::size_t>(s.top_k);
  // The experts' output is the user's: check it on every rank before rows move back.
  std::string why = !not_tensors.empty() ? not_tensors
                                         : check_tensor("expert output", y_in, scalar_type_of(dtype_),
                                                        static_cast<std::int64_t>(R), static_cast<std::int64_t>(H));
  // A second combine of one dispatch is also what recomputing an activation checkpoint that
  // holds combine without its dispatch does (torch.utils.checkpoint, either mode): every rank
  // recomputes there, so every rank raises this, agreed below.
  if (why.empty() && s.combined)
    why = "this dispatch handle was already combined (one combine per dispatch; an activation checkpoint "
          "(torch.utils.checkpoint) around combine without its dispatch is not supported: it recomputes combine "
          "on the same handle; checkpoint the whole layer, dispatch and the experts, or the experts alone)";
  if (why.empty())
    why = check_tensor("routing weights", weights, at::kFloat, static_cast<std::int64_t>(N),
                       static_cast<std::int64_t>(ks));
  // A record of dispatch's size and kind `combine`: ranks whose calls got out of step (one
  // in dispatch, one in combine) raise on every rank instead of mismatching sizes.
  const std::vector<std::int64_t> no_counts(static_cast<std::size_t>(m.experts()), 0);
  epx::detail::exchange_records(*ep_, why.empty() ? 0 : 1, N, H, s.top_k, world_rank_, no_counts.data(),
                                no_counts.size(), why, "epx_torch combine", s.masked ? m.ep() : tp,
                                epx::detail::record_combine);
  s.combined = true;
  keep = keep && s.training;  // what backward needs: the experts' output (send order on the all-to-all path)
  const at::Tensor y = y_in.contiguous(), w = weights.contiguous();
  const at::ScalarType st = scalar_type_of(dtype_);
  at::Tensor out = pool_.get(tensor_pool::out, static_cast<std::int64_t>(N), static_cast<std::int64_t>(H), st);
  if (!s.masked) {
    const epx::row_slice sl = s.slice;
    const std::size_t n = sl.size();
    T* o = ptr<T>(out);
    epx::exec::fill_zero(ex, o, sl.begin * H);
    epx::exec::fill_zero(ex, o + sl.end * H, (N - sl.end) * H);
    const float* wp = ptr<const float>(w) + sl.begin * ks;
    // 6. The outputs back to their send positions (read in place with shared memory, except
    // where backward needs them: `keep` keeps them in send order for the routing-weight
    // gradients); 7. the weighted sum in slot order.
    at::Tensor back;
    std::vector<const T*> table;
    const auto* pos = ptr<const std::int64_t>(s.pos);
    if (returned_rows(s, static_cast<const T*>(ptr<T>(y)), !keep, tensor_pool::back, back, table))
      epx::kernels::combine(ex, n, H, s.top_k, epx::kernels::row_table<T>{table.data()}, wp, pos, o + sl.begin * H);
    else
      epx::kernels::combine(ex, n, H, s.top_k, static_cast<const T*>(ptr<T>(back)), wp, pos, o + sl.begin * H);
    if (keep) s.y = back;
    if (tp > 1) epx::all_reduce(*tp_, epx::span<T>(o, N * H));
  } else {
    epx::kernels::combine(ex, N, H, s.top_k, static_cast<const T*>(ptr<T>(y)), ptr<const float>(w),
                          ptr<const std::int64_t>(s.pos), ptr<T>(out));
    epx::all_reduce(*ep_, epx::span<T>(ptr<T>(out), N * H));
    if (keep) s.y = y;
  }
  (void)R;
  return out;
}

template <class Exec, class Comm>
std::tuple<at::Tensor, at::Tensor> basic_torch_layer<Exec, Comm>::combine_backward(
    const std::shared_ptr<dispatch_state>& s, const at::Tensor& grad_out) {
  EPX_REQUIRE(s != nullptr, epx::errc::input, "combine backward needs the handle of a dispatch");
  EPX_REQUIRE(s->training, epx::errc::input,
              "combine backward: the dispatch of this handle ran without gradients (under torch.no_grad or "
              "torch.inference_mode); run dispatch and combine under the same grad mode");
  EPX_REQUIRE(!s->backed, epx::errc::input,
              "combine backward already ran for this dispatch: one backward per forward (a second backward "
              "through combine with retain_graph=True, or torch.autograd.gradcheck, is not supported)");
  EPX_REQUIRE(s->combined && s->y.defined(), epx::errc::input,
              "combine backward needs the handle of a training dispatch and combine");
  std::string why = check_tensor("grad_out", grad_out, scalar_type_of(dtype_), static_cast<std::int64_t>(s->rows),
                                 static_cast<std::int64_t>(s->hidden));
  EPX_REQUIRE(why.empty(), epx::errc::input, why);
  const typename layer_side<Exec>::guard on_device(device_);
  return with_type(dtype_, [&](auto t) { return combine_backward_t<decltype(t)>(*s, grad_out.contiguous()); });
}

template <class Exec, class Comm>
template <class T>
std::tuple<at::Tensor, at::Tensor> basic_torch_layer<Exec, Comm>::combine_backward_t(dispatch_state& s, const at::Tensor& grad_out) {
  const auto ex = exec();
  const epx::mesh& m = *mesh_;
  const int L = m.local_experts(), tp = m.tp(), me = m.ep_rank(world_rank_);
  const std::size_t H = s.hidden, N = s.rows, R = s.expert_rows;
  const auto ks = static_cast<std::size_t>(s.top_k);
  const at::ScalarType st = scalar_type_of(dtype_);
  at::Tensor grad_w = pool_.get(tensor_pool::grad_w, static_cast<std::int64_t>(N), static_cast<std::int64_t>(ks), at::kFloat);
  at::Tensor grad_rows = pool_.get(tensor_pool::grad_rows, static_cast<std::int64_t>(R), static_cast<std::int64_t>(H), st);
  const T* g = ptr<const T>(grad_out);
  if (!s.masked) {
    const epx::row_slice sl = s.slice;
    const std::size_t n = sl.size(), S = n * ks;
    // grad_y rows in send order: w * grad_out of the position's row; grad_w from the
    // outputs kept in send order.
    at::Tensor send;
    T* sp = send_buffer<T>(S, tensor_pool::grad_send, send);
    float* gw = ptr<float>(grad_w);
    epx::exec::fill_zero(ex, gw, sl.begin * ks);
    epx::exec::fill_zero(ex, gw + sl.end * ks, (N - sl.end) * ks);
    epx::kernels::gather(ex, S, H, g + sl.begin * H, ptr<const std::int64_t>(s.src_row),
                         ptr<const float>(s.weights_at), sp);
    epx::kernels::weight_gradients(ex, n, H, s.top_k, static_cast<const T*>(ptr<T>(s.y)), g + sl.begin * H,
                                   ptr<const std::int64_t>(s.pos), ptr<float>(grad_w) + sl.begin * ks);
    epx::detail::zero_padding(ex, ptr<T>(grad_rows), s.layout, me, H);
    epx::all_to_allv_segments(*ep_, static_cast<const T*>(sp), epx::make_span(s.seg.send_counts),
                              epx::make_span(s.seg.send_displs), ptr<T>(grad_rows),
                              epx::make_span(s.seg.recv_counts), epx::make_span(s.seg.recv_displs),
                              static_cast<std::size_t>(L), H);
    if (tp > 1) epx::all_reduce(*tp_, epx::span<float>(ptr<float>(grad_w), N * ks));
  } else {
    epx::kernels::gather(ex, R, H, g, ptr<const std::int64_t>(s.row_source),
                         ptr<const float>(s.weights_at), ptr<T>(grad_rows));
    epx::kernels::weight_gradients(ex, N, H, s.top_k, static_cast<const T*>(ptr<T>(s.y)), g,
                                   ptr<const std::int64_t>(s.pos), ptr<float>(grad_w));
    epx::all_reduce(*ep_, epx::span<float>(ptr<float>(grad_w), N * ks));
  }
  s.y = at::Tensor();  // read once
  s.backed = true;
  return {grad_rows, grad_w};
}

template <class Exec, class Comm>
at::Tensor basic_torch_layer<Exec, Comm>::dispatch_backward(const std::shared_ptr<dispatch_state>& s,
                                                            const at::Tensor& grad_rows) {
  EPX_REQUIRE(s != nullptr, epx::errc::input, "dispatch backward needs the handle of a dispatch");
  std::string why = check_tensor("grad of the expert rows", grad_rows, scalar_type_of(dtype_),
                                 static_cast<std::int64_t>(s->expert_rows), static_cast<std::int64_t>(s->hidden));
  EPX_REQUIRE(why.empty(), epx::errc::input, why);
  const typename layer_side<Exec>::guard on_device(device_);
  return with_type(dtype_, [&](auto t) { return dispatch_backward_t<decltype(t)>(*s, grad_rows.contiguous()); });
}

template <class Exec, class Comm>
template <class T>
at::Tensor basic_torch_layer<Exec, Comm>::dispatch_backward_t(dispatch_state& s, const at::Tensor& grad_rows) {
  const auto ex = exec();
  const epx::mesh& m = *mesh_;
  const int tp = m.tp();
  const std::size_t H = s.hidden, N = s.rows;
  const at::ScalarType st = scalar_type_of(dtype_);
  at::Tensor grad_x = pool_.get(tensor_pool::grad_x, static_cast<std::int64_t>(N), static_cast<std::int64_t>(H), st);
  T* gx = ptr<T>(grad_x);
  if (!s.masked) {
    const epx::row_slice sl = s.slice;
    const std::size_t n = sl.size();
    epx::exec::fill_zero(ex, gx, sl.begin * H);
    epx::exec::fill_zero(ex, gx + sl.end * H, (N - sl.end) * H);
    at::Tensor back;
    std::vector<const T*> table;
    const auto* pos = ptr<const std::int64_t>(s.pos);
    if (returned_rows(s, static_cast<const T*>(ptr<T>(grad_rows)), true, tensor_pool::grad_back, back, table))
      epx::kernels::reduce(ex, n, H, s.top_k, epx::kernels::row_table<T>{table.data()}, pos, gx + sl.begin * H);
    else
      epx::kernels::reduce(ex, n, H, s.top_k, static_cast<const T*>(ptr<T>(back)), pos, gx + sl.begin * H);
    if (tp > 1) epx::all_reduce(*tp_, epx::span<T>(gx, N * H));
  } else {
    epx::kernels::reduce(ex, N, H, s.top_k, static_cast<const T*>(ptr<T>(grad_rows)), ptr<const std::int64_t>(s.pos),
                         gx);
    epx::all_reduce(*ep_, epx::span<T>(gx, N * H));
  }
  return grad_x;
}

template <class Exec, class Comm>
template <class T>
bool basic_torch_layer<Exec, Comm>::returned_rows(const dispatch_state& s, const T* expert_rows, bool in_place,
                                                  int slot, at::Tensor& back, std::vector<const T*>& table) {
  const auto L = static_cast<std::size_t>(mesh_->local_experts());
  const std::size_t H = s.hidden, S = s.slice.size() * static_cast<std::size_t>(s.top_k);
  const epx::detail::segments& g = s.seg;
  if constexpr (std::is_same_v<Comm, torch_communicator>) {
    if (in_place) table.assign(S, nullptr);
    if (in_place && ep_->all_to_allv_segments_in_place(expert_rows, g.recv_counts.data(), g.recv_displs.data(),
                                                       g.send_counts.data(), L, H,
                                                       [&](std::size_t q, std::size_t i, const T* rows) {
                                                         const std::size_t j = q * L + i, at = g.send_displs[j];
                                                         for (std::size_t r = 0; r < g.send_counts[j]; ++r)
                                                           table[at + r] = rows + r * H;
                                                       }))
      return true;
  }
  back = pool_.get(slot, static_cast<std::int64_t>(S), static_cast<std::int64_t>(H), scalar_type_of(dtype_));
  epx::all_to_allv_segments(*ep_, expert_rows, epx::make_span(g.recv_counts), epx::make_span(g.recv_displs), ptr<T>(back),
                            epx::make_span(g.send_counts), epx::make_span(g.send_displs), L, H);
  return false;
}

namespace layer_detail {
// Why this rank cannot hand epx's hooks the tensor `g` ("" when it can): the hooks take a
// contiguous tensor on the layer's device of one of their element types.
inline std::string unreducible(const at::Tensor& g, const at::Device& d) {
  if (!g.defined())
    return "the gradient is None or not a tensor (a parameter without a gradient on this rank, one whose experts "
           "received no rows say, reduces torch.zeros_like(param) there)";
  if (g.is_leaf() && g.requires_grad())
    return "the gradient is a leaf tensor that requires grad (a parameter itself, say, where its .grad goes), "
           "which cannot be changed in place";
  if (g.device() != d || !g.is_contiguous())
    return concat("the gradient must be a contiguous tensor on ", d.str());
  switch (g.scalar_type()) {
    case at::kFloat: case at::kDouble: case at::kBFloat16: case at::kHalf: return {};
    default:
      return concat("gradients of dtype ", c10::toString(g.scalar_type()),
                    " cannot be reduced (float32, float64, bfloat16, float16)");
  }
}

// Runs `reduce` on `g` as a span of its element type. The ranks' agreement is epx's own
// (epx/grad/hooks.hpp): on the host layer (gloo) each hook all-gathers one small record per
// rank over `first` (efsdp or fsdp, named `first_name`), then over `second` (dp_replicate),
// and every rank of those groups raises errc::input, naming the hook and the ranks, when
// two pass different sizes or element types, before anything is reduced (the sums gather
// every rank's block: blocks of different sizes would read past the smaller ones, and gloo
// aborts the process on a size it did not expect). A rank whose tensor the hooks cannot
// take joins that agreement through refuse_hook with its reason instead, so the others
// raise too rather than wait in the sum. Device layers do not agree (it would add a host
// wait to every reduction): there such a rank raises alone.
template <class Comm, class F>
void reduce_as_typed(Comm& first, const char* first_name, Comm& second, const at::Tensor& g, const at::Device& d,
                     const char* what, int world_rank, F&& reduce) {
  if (const std::string why = unreducible(g, d); !why.empty())
    epx::detail::refuse_hook(what, first, first_name, second, false, why, world_rank);
  const auto n = static_cast<std::size_t>(g.numel());
  switch (g.scalar_type()) {
    case at::kFloat: reduce(epx::span<float>(ptr<float>(g), n)); break;
    case at::kDouble: reduce(epx::span<double>(ptr<double>(g), n)); break;
    case at::kBFloat16: reduce(epx::span<epx::bf16>(ptr<epx::bf16>(g), n)); break;
    case at::kHalf: reduce(epx::span<epx::fp16>(ptr<epx::fp16>(g), n)); break;
    default: break;  // refused above
  }
}
}  // namespace layer_detail

template <class Exec, class Comm>
void basic_torch_layer<Exec, Comm>::reduce_expert_gradients(at::Tensor& grad) {
  const typename layer_side<Exec>::guard on_device(device_);
  layer_detail::reduce_as_typed(*efsdp_, "efsdp", *dp_replicate_, grad, device(), "reduce_expert_gradients",
                                world_rank_, [&](auto g) {
                                  epx::reduce_expert_gradients(*efsdp_, *dp_replicate_, *mesh_, g, world_rank_);
                                });
}

template <class Exec, class Comm>
void basic_torch_layer<Exec, Comm>::reduce_dense_gradients(at::Tensor& grad) {
  const typename layer_side<Exec>::guard on_device(device_);
  layer_detail::reduce_as_typed(*fsdp_, "fsdp", *dp_replicate_, grad, device(), "reduce_dense_gradients",
                                world_rank_, [&](auto g) {
                                  epx::reduce_dense_gradients(*fsdp_, *dp_replicate_, *mesh_, g, world_rank_);
                                });
}

}  // namespace epx_torch

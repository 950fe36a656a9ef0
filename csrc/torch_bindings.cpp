// The whole op surface of kvflow in one place: every schema of the `kvflow` torch library,
// the CPU and CUDA implementations registered against it, and the pybind11 classes of the
// kvflow._C module. `Tensor!` marks what an op writes; ops that write into caller-allocated
// tensors return ().
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <stdexcept>

#include "block_allocator.h"
#include "kvflow/cpu/batch_invariance.h"
#include "kvflow/cpu/kernel_table.h"
#include "cpu/decode_steps.h"
#include "cpu/executor.h"
#include "ops.h"

TORCH_LIBRARY(kvflow, m) {
  // out[t] = weight[token_ids[t]] * scale (the CPU checks every id first; CUDA writes zeros for one out of
  // range). scale: Gemma's sqrt(hidden_size), in the weight's dtype.
  m.def("embedding(Tensor! out, Tensor token_ids, Tensor weight, float scale=1.0) -> ()");
  // out = input * rsqrt(mean(input^2, -1) + epsilon) * (weight + weight_offset), float32 math.
  // weight_offset = 1.0 gives the Gemma convention.
  m.def("rms_norm(Tensor! out, Tensor input, Tensor weight, float epsilon, float weight_offset=0.0) -> ()");
  // residual += input; input = rms_norm(residual) (residual rounded to its dtype first).
  m.def(
      "fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor weight, float epsilon, "
      "float weight_offset=0.0) -> ()");
  // residual += rms_norm(input) (the norm rounded to its dtype first): a post-norm and its residual add.
  m.def(
      "rms_norm_add(Tensor! residual, Tensor input, Tensor weight, float epsilon, float weight_offset=0.0) -> ()");
  // Rotates query and key in place by the angles cos_sin_cache[positions] (cos half, then sin half).
  m.def(
      "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, Tensor cos_sin_cache, "
      "bool is_neox) -> ()");
  // out = act(input[..., :d]) * input[..., d:]
  m.def("silu_and_mul(Tensor! out, Tensor input) -> ()");
  m.def("gelu_tanh_and_mul(Tensor! out, Tensor input) -> ()");
  m.def("gelu_and_mul(Tensor! out, Tensor input) -> ()");
  // key_cache[slot // block_size, slot % block_size] = key[token] for every token whose slot != -1.
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, "
      "Tensor slot_mapping) -> ()");
  // For every (src, dst) row of block_mapping, in every layer: cache[dst] = cache[src].
  m.def("copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()");
  // out = softmax(scale * query . keys) . values over each request's paged context, causal (and
  // windowed when sliding_window > 0), GQA: query head h reads kv head h / (num_q_heads / num_kv_heads).
  m.def(
      "paged_attention(Tensor! out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor cu_seqlens_q, Tensor seq_lens, float scale, int max_query_len, int max_seq_len, "
      "int sliding_window=-1, float logits_soft_cap=0.0, Tensor(a!)? workspace=None) -> ()");
  // One token per row: argmax where temperature == 0; otherwise a draw from softmax(logits / T)
  // restricted to the top_k, then the top_p mass, then probabilities >= min_p * max, with
  // Philox keyed by (seeds[row], offsets[row]).
  m.def(
      "sample(Tensor! out, Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, "
      "Tensor seeds, Tensor offsets) -> ()");
  // A family's last step on float32 logits, in place: logits / divisor, then
  // soft_cap * tanh(logits / soft_cap) when soft_cap > 0.
  // Speculative decoding: each request's drafts accepted while the target's own draws equal them.
  m.def(
      "rejection_sample(Tensor! out, Tensor! num_emitted, Tensor logits, Tensor draft_token_ids, Tensor cu_rows, "
      "Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor seeds, Tensor offsets) -> ()");
  m.def("scale_logits(Tensor! logits, float divisor=1.0, float soft_cap=0.0) -> ()");
  // The distribution sample() draws from, as logits: divided by T, filtered tokens set to -inf.
  m.def("apply_sampling_filters(Tensor! logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p) -> ()");
  // Structured output: in the logits rows a grammar constrains, every token its bitmask does not
  // allow (bit t % 32 of word t / 32; tokens past the last word too) becomes -inf.
  m.def("apply_token_bitmask(Tensor! logits, Tensor bitmask, Tensor? rows=None) -> ()");
  // Repetition (prompt and output tokens), frequency and presence (output counts) penalties.
  m.def(
      "apply_penalties(Tensor! logits, Tensor prompt_token_ids, Tensor prompt_offsets, Tensor output_token_ids, "
      "Tensor output_offsets, Tensor repetition_penalty, Tensor frequency_penalty, Tensor presence_penalty) -> ()");
  // log_softmax(logits) at token_ids, and the num_top most likely tokens with their log-probabilities.
  m.def("compute_logprobs(Tensor logits, Tensor token_ids, int num_top) -> (Tensor, Tensor, Tensor)");
  // out = input @ weight^T (+ bias) for a few rows (decode), reading the weights once. CPU only.
  m.def("small_linear(Tensor! out, Tensor input, Tensor weight, Tensor? bias=None) -> ()");
  // A bfloat16 weight reordered once into the panels packed_linear reads. CPU only.
  // With gate_up, a gated MLP's [gate; up] weight, in the order packed_silu_and_mul reads it.
  m.def("pack_linear_weight(Tensor weight, bool gate_up=False) -> Tensor");
  // out = input @ weight^T (+ bias) for many rows, from pack_linear_weight(weight). CPU only.
  m.def("packed_linear(Tensor! out, Tensor input, Tensor packed_weight, Tensor? bias=None) -> ()");
  // out = silu(input @ gate^T) * (input @ up^T) from pack_linear_weight(weight, gate_up=True). CPU only.
  m.def("packed_silu_and_mul(Tensor! out, Tensor input, Tensor packed_gate_up) -> ()");
  // out = input @ weight^T (+ bias), weight in GGUF blocks of GGML type ggml_type (Q4_0, Q4_1,
  // Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), uint8 [out_features, row bytes] as the file stores it.
  m.def("quantized_linear(Tensor! out, Tensor input, Tensor weight, int ggml_type, Tensor? bias=None) -> ()");
  // The rows of a table in GGUF blocks (types as quantized_linear) that token_ids name, dequantized
  // into out's dtype, times scale.
  m.def("quantized_embedding(Tensor! out, Tensor token_ids, Tensor weight, int ggml_type, float scale=1.0) -> ()");
}

TORCH_LIBRARY_IMPL(kvflow, CPU, m) {
  m.impl("embedding", &kvflow::cpu::embedding);
  m.impl("rms_norm", &kvflow::cpu::rms_norm);
  m.impl("fused_add_rms_norm", &kvflow::cpu::fused_add_rms_norm);
  m.impl("rms_norm_add", &kvflow::cpu::rms_norm_add);
  m.impl("rotary_embedding", &kvflow::cpu::rotary_embedding);
  m.impl("silu_and_mul", &kvflow::cpu::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &kvflow::cpu::gelu_tanh_and_mul);
  m.impl("gelu_and_mul", &kvflow::cpu::gelu_and_mul);
  m.impl("reshape_and_cache", &kvflow::cpu::reshape_and_cache);
  m.impl("copy_blocks", &kvflow::cpu::copy_blocks);
  m.impl("paged_attention", &kvflow::cpu::paged_attention);
  m.impl("sample", &kvflow::cpu::sample);
  m.impl("rejection_sample", &kvflow::cpu::rejection_sample);
  m.impl("scale_logits", &kvflow::cpu::scale_logits);
  m.impl("apply_sampling_filters", &kvflow::cpu::apply_sampling_filters);
  m.impl("apply_token_bitmask", &kvflow::cpu::apply_token_bitmask);
  m.impl("apply_penalties", &kvflow::cpu::apply_penalties);
  m.impl("compute_logprobs", &kvflow::cpu::compute_logprobs);
  m.impl("small_linear", &kvflow::cpu::small_linear);
  m.impl("pack_linear_weight", &kvflow::cpu::pack_linear_weight);
  m.impl("packed_linear", &kvflow::cpu::packed_linear);
  m.impl("packed_silu_and_mul", &kvflow::cpu::packed_silu_and_mul);
  m.impl("quantized_linear", &kvflow::cpu::quantized_linear);
  m.impl("quantized_embedding", &kvflow::cpu::quantized_embedding);
}

#ifdef KVFLOW_WITH_CUDA
TORCH_LIBRARY_IMPL(kvflow, CUDA, m) {
  m.impl("embedding", &kvflow::cuda::embedding);
  m.impl("rms_norm", &kvflow::cuda::rms_norm);
  m.impl("fused_add_rms_norm", &kvflow::cuda::fused_add_rms_norm);
  m.impl("rms_norm_add", &kvflow::cuda::rms_norm_add);
  m.impl("rotary_embedding", &kvflow::cuda::rotary_embedding);
  m.impl("silu_and_mul", &kvflow::cuda::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &kvflow::cuda::gelu_tanh_and_mul);
  m.impl("gelu_and_mul", &kvflow::cuda::gelu_and_mul);
  m.impl("reshape_and_cache", &kvflow::cuda::reshape_and_cache);
  m.impl("copy_blocks", &kvflow::cuda::copy_blocks);
  m.impl("paged_attention", &kvflow::cuda::paged_attention);
  m.impl("sample", &kvflow::cuda::sample);
  m.impl("rejection_sample", &kvflow::cuda::rejection_sample);
  m.impl("scale_logits", &kvflow::cuda::scale_logits);
  m.impl("apply_sampling_filters", &kvflow::cuda::apply_sampling_filters);
  m.impl("apply_token_bitmask", &kvflow::cuda::apply_token_bitmask);
  m.impl("apply_penalties", &kvflow::cuda::apply_penalties);
  m.impl("compute_logprobs", &kvflow::cuda::compute_logprobs);
  m.impl("quantized_linear", &kvflow::cuda::quantized_linear);
  m.impl("quantized_embedding", &kvflow::cuda::quantized_embedding);
}
#endif

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "kvflow's compiled core: importing it registers the torch.ops.kvflow ops.";
#ifdef KVFLOW_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif

  m.def("cpu_features", &kvflow::cpu::cpu_features,
        "Each x86 feature kvflow asks about (by /proc/cpuinfo's names), and whether this CPU has it.");
  m.def(
      "executor_region_stats",
      [] {
        const kvflow::cpu::RegionStats s = kvflow::cpu::executor_region_stats();
        return py::make_tuple(s.steps, s.wall_seconds, s.thread_seconds, s.wait_thread_seconds,
                              s.prepare_seconds);
      },
      "(replays, wall seconds, thread-seconds, thread-seconds waiting at barriers, seconds preparing before the "
      "region) of every CPU program replay with two or more threads so far in this process.");
  m.def("set_executor_op_timing", &kvflow::cpu::set_executor_op_timing, py::arg("on"),
        "Switches the CPU programs' per-op timing on or off (off at start: it reads the clock twice a phase).");
  m.def(
      "executor_op_times",
      [] {
        py::list times;
        for (const kvflow::cpu::OpTime& t : kvflow::cpu::executor_op_times()) {
          times.append(py::make_tuple(t.op, t.phase, t.runs, t.run_thread_seconds, t.wait_thread_seconds));
        }
        return times;
      },
      "[(op, phase, runs, thread-seconds running, thread-seconds waiting at the barrier before it)] of every CPU "
      "program replay while op timing was on, each phase of each op summed over programs, replays and threads.");

  // A captured model step on the CPU (cpu/executor.h); kvflow.engine.cpu_programs builds them.
  using kvflow::cpu::CpuProgram;
  py::class_<CpuProgram>(m, "CpuProgram", R"doc(
A program of CPU op nodes, replayed inside one parallel region.

add(op, tensors, ints, floats) appends the node of one call of torch.ops.kvflow.<op>, its arguments
in schema order by kind (tensors, None for an absent optional one; ints and bools; floats); it
raises for an op without a node or arguments the op would refuse. run(max_query_len, max_seq_len)
replays every node over the tensors they were added with: all nodes check this step's metadata
first, so a bad step raises before anything is written.)doc")
      .def(py::init<>())
      .def(
          "add",
          [](CpuProgram& program, std::string op, std::vector<std::optional<at::Tensor>> tensors,
             std::vector<int64_t> ints, std::vector<double> floats) {
            program.add({std::move(op), std::move(tensors), std::move(ints), std::move(floats)});
          },
          py::arg("op"), py::arg("tensors"), py::arg("ints"), py::arg("floats"))
      .def("starts_shared", &CpuProgram::starts_shared, py::arg("index"),
           "Whether a barrier always precedes node `index`: memory only the nodes before it read may be reused "
           "from it on.")
      .def("run", &CpuProgram::run, py::arg("max_query_len"), py::arg("max_seq_len"),
           py::call_guard<py::gil_scoped_release>())
      .def("__len__", &CpuProgram::size)
      .def_property_readonly("replays", &CpuProgram::replays, "How many times run has replayed the program.");
  m.def(
      "run_decode_steps",
      [](CpuProgram& program, at::Tensor token_ids, at::Tensor positions, at::Tensor slot_mapping, at::Tensor seq_lens,
         at::Tensor block_tables, at::Tensor offsets, at::Tensor sampled, int64_t rows, int64_t steps,
         int64_t block_size, int64_t max_seq_len, at::Tensor stop_token_ids, at::Tensor tokens_out) {
        return kvflow::cpu::run_decode_steps(
            program, {token_ids, positions, slot_mapping, seq_lens, block_tables, offsets, sampled}, rows, steps,
            block_size, max_seq_len, stop_token_ids, tokens_out);
      },
      py::arg("program"), py::arg("token_ids"), py::arg("positions"), py::arg("slot_mapping"), py::arg("seq_lens"),
      py::arg("block_tables"), py::arg("offsets"), py::arg("sampled"), py::arg("rows"), py::arg("steps"),
      py::arg("block_size"), py::arg("max_seq_len"), py::arg("stop_token_ids"), py::arg("tokens_out"),
      py::call_guard<py::gil_scoped_release>(), R"doc(
Runs up to `steps` decode steps of a program back to back (csrc/cpu/decode_steps.h): the buffers
hold the first step's inputs of its first `rows` rows; each later step feeds every row the token it
sampled, one position on; they end early once every row has drawn one of stop_token_ids. Writes the
sampled tokens to tokens_out [steps, rows] and returns each step run's end in seconds before the
last one's (as many as steps ran).)doc");

  m.def("supported_cpu_isas", &kvflow::cpu::supported_isas,
        "Instruction sets the CPU kernels can use on this machine, narrowest first.");
  m.def(
      "cpu_isa", [] { return std::string(kvflow::cpu::active_kernels().isa); },
      "The instruction set the CPU kernels use now.");
  m.def("set_cpu_isa", &kvflow::cpu::set_isa, py::arg("name"),
        "Switch the CPU kernels to 'scalar', 'avx2', 'avx512' or 'avx512_bf16' (must be supported here).");
  m.def("batch_invariant", &kvflow::cpu::batch_invariant,
        "Whether the CPU kernels compute each row in one order whatever the batch (batch_invariance.h).");
  m.def("set_batch_invariant", &kvflow::cpu::set_batch_invariant, py::arg("on"),
        "Turns batch-invariant mode on or off for every CPU kernel of this process.");

  // The KV block pool the scheduler drives every step; see block_allocator.h for the semantics.
  using kvflow::BlockAllocator;
  using BlockIds = std::vector<BlockAllocator::BlockId>;
  py::register_exception<kvflow::OutOfBlocksError>(m, "OutOfBlocksError", PyExc_RuntimeError);
  py::class_<BlockAllocator> block_allocator(m, "BlockAllocator", R"doc(
A pool of KV cache block ids 0..num_blocks-1 with reference counts and a prefix cache.

A block is used (ref_count > 0), evictable (ref_count 0 but cached: lookup() can still find it;
allocate() reuses it only when no free block is left, least recently released first) or free.
num_free_blocks counts free + evictable, so num_free_blocks + num_used_blocks == num_blocks.

Errors raise before anything changes:
  IndexError        a block id outside [0, num_blocks)
  ValueError        double free; fork or register_block of a block not in use; len(token_ids) !=
                    block_size; re-registering a cached block with other content; allocate(n)
                    with n < 0 or n > num_blocks (it could never succeed)
  OutOfBlocksError  (a RuntimeError) allocate(n) when fewer than n blocks are allocatable now
Not thread-safe.)doc");
  block_allocator.attr("ROOT_HASH") = py::int_(BlockAllocator::kRootHash);  // parent_hash of a first block
  block_allocator.def(py::init<int64_t, int64_t>(), py::arg("num_blocks"), py::arg("block_size"))
      .def_static(
          "hash_block",
          [](uint64_t parent_hash, const std::vector<int32_t>& token_ids) {
            return BlockAllocator::chain_hash(parent_hash, token_ids.data(), token_ids.size());
          },
          py::arg("parent_hash"), py::arg("token_ids"),
          "The chained hash register_block() returns for this parent hash and these tokens.")
      .def("allocate", &BlockAllocator::allocate, py::arg("n"),
           "n distinct block ids, each with ref_count 1: free blocks first, then evictable ones, least "
           "recently released first (their cache entries are dropped). All or nothing.")
      .def("can_allocate", &BlockAllocator::can_allocate, py::arg("n"), "Whether allocate(n) would succeed.")
      .def("free", py::overload_cast<BlockAllocator::BlockId>(&BlockAllocator::free), py::arg("block_ids"),
           "Drops one reference per id (an int or a list; an id may repeat up to its ref_count). A list is "
           "released last to first, so freeing a block table makes its tail the first to be evicted. A "
           "cached block at ref_count 0 stays findable by lookup() until the pool reuses it.")
      .def("free", py::overload_cast<const BlockIds&>(&BlockAllocator::free), py::arg("block_ids"))
      .def("fork", &BlockAllocator::fork, py::arg("block_ids"),
           "Adds one reference per id, to share blocks (e.g. a prompt's, for parallel sampling); each must "
           "be in use.")
      .def("register_block", &BlockAllocator::register_block, py::arg("block_id"), py::arg("parent_hash"),
           py::arg("token_ids"),
           "Caches the used, full block block_id as holding token_ids (len == block_size) after the prefix "
           "whose last block hash is parent_hash (ROOT_HASH for a first block). Returns the block's hash, "
           "the parent_hash of the next block. If another block already caches this content, that entry "
           "stays and block_id stays uncached (the hash is returned all the same).")
      .def("lookup", &BlockAllocator::lookup, py::arg("token_ids"),
           "The block ids caching the longest prefix of the full blocks of token_ids (a trailing partial "
           "block is ignored), stopping at the first miss; each gets one more reference, to be freed like "
           "allocated ones. Stored tokens and parent hashes are compared, so a hash collision can only "
           "miss. Adds the number of full blocks to stats()['queries'] and of returned ones to 'hits'.")
      .def("reset_prefix_cache", &BlockAllocator::reset_prefix_cache,
           "Drops the cache entries of all evictable blocks (they become free); used blocks keep theirs. "
           "Returns the number of entries dropped.")
      .def("ref_count", &BlockAllocator::ref_count, py::arg("block_id"), "The block's reference count.")
      .def("is_cached", &BlockAllocator::is_cached, py::arg("block_id"),
           "Whether the block has a prefix cache entry (lookup() can find it).")
      .def_property_readonly("block_size", &BlockAllocator::block_size, "Tokens per block.")
      .def_property_readonly("num_blocks", &BlockAllocator::num_blocks, "Blocks in the pool.")
      .def_property_readonly("num_free_blocks", &BlockAllocator::num_free_blocks,
                             "Blocks allocate() can hand out: free plus evictable (cached, unused).")
      .def_property_readonly("num_used_blocks", &BlockAllocator::num_used_blocks, "Blocks with ref_count > 0.")
      .def_property_readonly("num_cached_blocks", &BlockAllocator::num_cached_blocks,
                             "Blocks with a prefix cache entry, used or evictable.")
      .def_property_readonly("num_evictable_blocks", &BlockAllocator::num_evictable_blocks,
                             "Cached blocks with ref_count 0 (counted in num_free_blocks).")
      .def(
          "stats",
          [](const BlockAllocator& self) {
            const BlockAllocator::Stats s = self.stats();
            py::dict d;
            d["free"] = s.free;
            d["used"] = s.used;
            d["cached"] = s.cached;
            d["hits"] = s.hits;
            d["queries"] = s.queries;
            return d;
          },
          "{'free', 'used', 'cached'}: block counts as the properties above; {'hits', 'queries'}: blocks "
          "returned by and full blocks passed to lookup() since construction (hit rate = hits / queries).")
      .def("check_invariants", &BlockAllocator::check_invariants,
           "Walks every internal structure (O(num_blocks)); raises RuntimeError if any is inconsistent. "
           "For tests.")
      .def("__repr__", [](const BlockAllocator& self) {
        return "BlockAllocator(num_blocks=" + std::to_string(self.num_blocks()) +
               ", block_size=" + std::to_string(self.block_size()) +
               ", free=" + std::to_string(self.num_free_blocks()) +
               ", used=" + std::to_string(self.num_used_blocks()) +
               ", cached=" + std::to_string(self.num_cached_blocks()) + ")";
      });
}

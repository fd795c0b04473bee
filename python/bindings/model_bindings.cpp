// Python bindings of the model module (include/metile/model.h) and the GPU engine (engine.h):
//   metile.load_model(path, dtype="bf16", quantize=None, group_size=None, max_seq=0, backend="cpu")
//       -> Model (backend="cpu") or CudaModel (backend="cuda": weights uploaded once, the fused engine)
//     .logits(ids) -> float32 numpy [len(ids), vocab], a fresh sequence each call
//     .generate(ids, n, temperature=0.0, top_k=0, top_p=1.0, seed=0, ignore_eos=False) -> int32 numpy
//         [at most n], greedy at temperature 0, else sampled (SamplingOptions), ending after an
//         end-of-sequence token (.eos_token_ids) unless ignore_eos
//   backend="cuda" without a GPU (or in a build without the CUDA toolkit) raises ValueError, as
//   `metile logits --backend cuda` exits 2.
//   metile.synth_model(path, preset="tiny", arch=None, layers=None, seed=0, quantize=None,
//                      group_size=None, tie_word_embeddings=None, config_spelling=4, max_shard_mb=2000)
// Bad checkpoints and arguments raise ValueError with the C++ message.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>

#include "bindings.h"
#include "metile/model.h"
#ifdef METILE_HAVE_CUDA_BACKEND
#include "metile/engine.h"
#endif

namespace metile::python {
namespace {

// quantize=None, 4 or 8 (True is not a bit count), and its group_size.
std::optional<AffineQuantization> quantization_of(const py::handle& bits, const py::handle& group_size) {
  if (bits.is_none()) {
    // Alone it would change nothing (as --group-size without --quantize on the command line).
    if (!group_size.is_none()) throw InputError("group_size: needs quantize (4 or 8 bits)");
    return std::nullopt;
  }
  const std::int64_t group = group_size.is_none() ? 64 : integer_argument("group_size", group_size);
  const std::int64_t value = integer_argument("quantize", bits);
  // Every bad count in this one wording (3 used to reach AffineQuantization::validate, which words it its own way).
  if (value != 4 && value != 8) throw InputError("quantize: bits must be 4 or 8, got " + std::to_string(value));
  if (group < 1 || group > (1 << 20)) throw InputError("group_size: must be 32, 64 or 128, got " + std::to_string(group));
  AffineQuantization format{static_cast<int>(value), static_cast<int>(group)};
  format.validate();
  return format;
}

// A UserWarning for each width quantize= leaves dense (matrices_left_dense, model.h), as the command
// line's note: the model would otherwise be partly bf16 without a word.
void warn_of_matrices_left_dense(const ModelConfig& config, const AffineQuantization& format) {
  for (const MatricesLeftDense& left : matrices_left_dense(config, format)) {
    const std::string message = "quantize=" + std::to_string(format.bits) + " leaves " + left.matrices + " dense: " +
                                std::to_string(left.columns) + " columns are not a multiple of group_size " +
                                std::to_string(format.group_size);
    warn_user(message);
  }
}

// The ids of one sequence; reading stops past the model's capacity (an endless iterator is an error,
// not a loop until memory runs out), named with where the capacity came from.
std::vector<std::int32_t> token_ids(const py::handle& ids, const DecoderModel& model) {
  const std::int64_t capacity = model.capacity();
  // Text is not ids, nor is a set or a dict: their order is not the caller's (a dict gave its keys).
  if (py::isinstance<py::str>(ids) || py::isinstance<py::bytes>(ids) || py::isinstance<py::bytearray>(ids) ||
      py::isinstance<py::set>(ids) || py::isinstance<py::frozenset>(ids) || py::isinstance<py::dict>(ids)) {
    throw py::type_error("ids must be a sequence of integers, got " + std::string(py::str(py::type::handle_of(ids).attr("__name__"))));
  }
  const py::object numpy_integer = py::module_::import("numpy").attr("integer");
  std::vector<std::int32_t> tokens;
  for (const py::handle& item : py::iter(ids)) {
    // bool is an int to Python, never a token id.
    if (py::isinstance<py::bool_>(item) || (!py::isinstance<py::int_>(item) && !py::isinstance(item, numpy_integer))) {
      throw py::type_error("ids must hold integers, got " + std::string(py::str(py::type::handle_of(item).attr("__name__"))));
    }
    const py::int_ value(py::reinterpret_borrow<py::object>(item));
    int overflow = 0;
    const long long id = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
    if (overflow != 0 || id < std::numeric_limits<std::int32_t>::min() || id > std::numeric_limits<std::int32_t>::max()) {
      throw InputError("ids: " + std::string(py::str(item)) + " is not a token id (ids are 32-bit integers below the vocabulary size)");
    }
    tokens.push_back(static_cast<std::int32_t>(id));
    if (static_cast<std::int64_t>(tokens.size()) > capacity) {
      throw InputError("ids: more than the KV-cache capacity of " + std::to_string(capacity) + " tokens (" +
                       model.capacity_source() + ")");
    }
  }
  if (tokens.empty()) throw InputError("ids is empty");
  return tokens;
}

py::array_t<float> logits_array(const std::vector<float>& logits, std::size_t rows, std::int64_t vocab) {
  py::array_t<float> array({static_cast<py::ssize_t>(rows), static_cast<py::ssize_t>(vocab)});
  std::copy(logits.begin(), logits.end(), array.mutable_data());
  return array;
}

py::array_t<std::int32_t> tokens_array(const Generation& generation) {
  py::array_t<std::int32_t> array(static_cast<py::ssize_t>(generation.tokens.size()));
  std::copy(generation.tokens.begin(), generation.tokens.end(), array.mutable_data());
  return array;
}

constexpr const char* kGenerateDoc =
    "Up to n tokens after ids (int32): greedy at temperature 0, else drawn from softmax(logits / temperature) "
    "kept to the tokens reaching the top_k-th largest logit (0: all) and to the most likely ones holding "
    "top_p of the probability (1: all), seeded by seed (the same tokens on every machine). Ends after the "
    "checkpoint's end-of-sequence token (eos_token_ids, kept as the last token) unless ignore_eos";

// generate's keywords after ids and n: the sampling (SamplingOptions, include/metile/model.h; its
// ValueError names the keyword) and the tokens that end the generation.
struct GenerateArguments {
  SamplingOptions sampling;
  std::vector<std::int64_t> stop_tokens;
};
GenerateArguments generate_arguments(const DecoderModel& model, const py::handle& temperature, const py::handle& top_k,
                                     const py::handle& top_p, const py::handle& seed, const py::handle& ignore_eos) {
  GenerateArguments arguments{{real_argument("temperature", temperature), integer_argument("top_k", top_k),
                               real_argument("top_p", top_p), unsigned_argument("seed", seed)},
                              {}};
  arguments.sampling.validate();
  if (!boolean_argument("ignore_eos", ignore_eos)) arguments.stop_tokens = model.config().eos_token_ids;
  return arguments;
}

// Runs `run` (a generation, a logits call) without the GIL, handing it `look`, which looks for Python's
// Ctrl-C (the GIL taken for the look alone) and is called after each of the prompt's steps and each
// generated token: a signal ends the call there with the handler's exception (KeyboardInterrupt).
// Unlooked-for, the interrupt was seen only after the last token, and looked for after generated tokens
// only, after minutes of a long prompt's steps. Only the main thread runs signal handlers, so only there
// is anything looked for, and at most every 0.25 s: taking the GIL after every token waited for it up to
// a switch interval (5 ms) whenever another thread was busy, 14x slower.
template <class Result>
Result run_until_interrupted(const std::function<Result(const std::function<void(std::int64_t)>&)>& run) {
  struct Interrupted {};
  std::optional<py::error_already_set> interruption;
  const py::module_ threading = py::module_::import("threading");
  const bool main_thread = threading.attr("current_thread")().is(threading.attr("main_thread")());
  constexpr auto kLookInterval = std::chrono::milliseconds(250);
  auto next_look = std::chrono::steady_clock::now() + kLookInterval;
  const std::function<void(std::int64_t)> look_for_signals = [&](std::int64_t) {
    if (!main_thread) return;
    const auto now = std::chrono::steady_clock::now();
    if (now < next_look) return;
    next_look = now + kLookInterval;
    const py::gil_scoped_acquire acquire;
    if (PyErr_CheckSignals() == 0) return;
    interruption.emplace();  // the handler's exception, taken from Python's error state
    throw Interrupted{};
  };
  try {
    const py::gil_scoped_release release;
    return run(look_for_signals);
  } catch (const Interrupted&) {
    throw *interruption;
  }
}

#ifdef METILE_HAVE_CUDA_BACKEND
// A model on the GPU as Python holds it: the host model (the step graphs), its weights on the
// device, and one session whose Executables every call reuses (a fresh sequence each call).
// Calls take turns on that session: two threads (a call runs without the GIL) each reset and fed it
// under the other, and so did a signal handler calling the model from inside its own generate.
// A thread waits its turn without the GIL; a call from inside a call on the same thread is refused.
struct PythonCudaModel {
  std::shared_ptr<DecoderModel> model;
  std::unique_ptr<CudaDecodeSession> session;
  std::mutex turn;
  std::atomic<std::thread::id> holder{};

  // Runs `work` on the session in this thread's turn; called without the GIL.
  template <class Work>
  auto in_turn(const char* call, Work&& work) {
    if (holder.load() == std::this_thread::get_id()) {
      throw InputError(std::string("CudaModel.") + call +
                       ": called from inside another call of the same model on this thread (a signal handler?); "
                       "the model runs one call at a time");
    }
    const std::lock_guard lock(turn);
    holder = std::this_thread::get_id();
    const struct Release {
      std::atomic<std::thread::id>& holder;
      ~Release() { holder = std::thread::id(); }
    } release{holder};
    return work();
  }
};
#endif

}  // namespace

void bind_model(py::module_& module) {
  // numpy imported and pybind11's numpy table filled now, while the import holds the GIL: filled
  // lazily by the first array a call returns, two threads could deadlock (one in the table's
  // static initialisation importing numpy, which wants the GIL; the other holding the GIL and
  // waiting for that initialisation).
  // Without numpy the module still loads (the graph and flow functions need none); the model's calls then fail alone.
  try {
    py::module_::import("numpy");
    (void)py::detail::npy_api::get();
  } catch (const py::error_already_set&) {
  }
  py::class_<DecoderModel, std::shared_ptr<DecoderModel>>(module, "Model",
                                                          "A decoder checkpoint loaded for CPU decoding")
      .def_property_readonly("vocab_size", [](const DecoderModel& model) { return model.config().vocab_size; })
      .def_property_readonly("num_layers", [](const DecoderModel& model) { return model.config().num_hidden_layers; })
      .def_property_readonly("dtype", [](const DecoderModel& model) { return std::string(dtype_name(model.dtype())); })
      .def_property_readonly("capacity", &DecoderModel::capacity)
      .def_property_readonly(
          "eos_token_ids", [](const DecoderModel& model) { return model.config().eos_token_ids; },
          "The end-of-sequence tokens generate stops after (generation_config.json's or config.json's eos_token_id)")
      .def(
          "logits",
          [](const DecoderModel& model, const py::handle& ids) {
            const std::vector<std::int32_t> tokens = token_ids(ids, model);
            const std::vector<float> logits =
                run_until_interrupted<std::vector<float>>([&](const std::function<void(std::int64_t)>& look) {
                  DecodeSession session(model);
                  return feed_a_step_at_a_time(session, tokens, [&] { look(-1); });
                });
            return logits_array(logits, tokens.size(), model.config().vocab_size);
          },
          py::arg("ids"), "Logits [len(ids), vocab] of a fresh sequence (float32)")
      .def(
          "generate",
          [](const DecoderModel& model, const py::handle& ids, const py::handle& n, const py::handle& temperature,
             const py::handle& top_k, const py::handle& top_p, const py::handle& seed, const py::handle& ignore_eos) {
            const std::vector<std::int32_t> tokens = token_ids(ids, model);
            const std::int64_t count = integer_argument("n", n);
            const GenerateArguments arguments = generate_arguments(model, temperature, top_k, top_p, seed, ignore_eos);
            return tokens_array(run_until_interrupted<Generation>([&](const std::function<void(std::int64_t)>& on_token) {
              DecodeSession session(model);
              const auto rest = feed_all_but_the_last_step(session, tokens, count, [&] { on_token(-1); });
              return generate(session, rest, count, arguments.sampling, arguments.stop_tokens, on_token);
            }));
          },
          py::arg("ids"), py::arg("n"), py::arg("temperature") = 0.0, py::arg("top_k") = 0, py::arg("top_p") = 1.0,
          py::arg("seed") = 0, py::arg("ignore_eos") = false, kGenerateDoc);

#ifdef METILE_HAVE_CUDA_BACKEND
  py::class_<PythonCudaModel, std::shared_ptr<PythonCudaModel>>(
      module, "CudaModel", "A decoder checkpoint on the GPU: weights uploaded once, the fused decode engine")
      .def_property_readonly("vocab_size", [](const PythonCudaModel& held) { return held.model->config().vocab_size; })
      .def_property_readonly("num_layers",
                             [](const PythonCudaModel& held) { return held.model->config().num_hidden_layers; })
      .def_property_readonly("dtype",
                             [](const PythonCudaModel& held) { return std::string(dtype_name(held.model->dtype())); })
      .def_property_readonly("capacity", [](const PythonCudaModel& held) { return held.model->capacity(); })
      .def_property_readonly(
          "eos_token_ids", [](const PythonCudaModel& held) { return held.model->config().eos_token_ids; },
          "The end-of-sequence tokens generate stops after (generation_config.json's or config.json's eos_token_id)")
      .def(
          "logits",
          [](PythonCudaModel& held, const py::handle& ids) {
            const std::vector<std::int32_t> tokens = token_ids(ids, *held.model);
            const std::vector<float> logits =
                run_until_interrupted<std::vector<float>>([&](const std::function<void(std::int64_t)>& look) {
                  return held.in_turn("logits", [&] {
                    held.session->reset();
                    return feed_a_step_at_a_time(*held.session, tokens, [&] { look(-1); });
                  });
                });
            return logits_array(logits, tokens.size(), held.model->config().vocab_size);
          },
          py::arg("ids"), "Logits [len(ids), vocab] of a fresh sequence (float32), computed on the GPU")
      .def(
          "generate",
          [](PythonCudaModel& held, const py::handle& ids, const py::handle& n, const py::handle& temperature,
             const py::handle& top_k, const py::handle& top_p, const py::handle& seed, const py::handle& ignore_eos) {
            const std::vector<std::int32_t> tokens = token_ids(ids, *held.model);
            const std::int64_t count = integer_argument("n", n);
            const GenerateArguments arguments =
                generate_arguments(*held.model, temperature, top_k, top_p, seed, ignore_eos);
            return tokens_array(run_until_interrupted<Generation>([&](const std::function<void(std::int64_t)>& on_token) {
              return held.in_turn("generate", [&] {
                held.session->reset();
                const auto rest = feed_all_but_the_last_step(*held.session, tokens, count, [&] { on_token(-1); });
                return generate(*held.session, rest, count, arguments.sampling, arguments.stop_tokens, on_token);
              });
            }));
          },
          py::arg("ids"), py::arg("n"), py::arg("temperature") = 0.0, py::arg("top_k") = 0, py::arg("top_p") = 1.0,
          py::arg("seed") = 0, py::arg("ignore_eos") = false, kGenerateDoc);
#endif

  module.def(
      "load_model",
      [](const FilePath& path, const Utf8Text& dtype_text, const py::handle& quantize,
         const py::handle& group_size, const py::handle& max_seq, const Utf8Text& backend_text) -> py::object {
        const std::string& dtype = dtype_text.value;
        const std::string& backend = backend_text.value;
        if (backend != "cpu" && backend != "cuda") {
          throw InputError("backend must be 'cpu' or 'cuda', got '" + backend + "'");
        }
        // A model runs in bf16 or f32 (as --dtype on the command line); parse_dtype's message lists every dtype.
        if (dtype != "bf16" && dtype != "f32") throw InputError("dtype must be 'bf16' or 'f32', got '" + dtype + "'");
        LoadOptions options;
        options.dtype = parse_dtype(dtype);
        options.quantize = quantization_of(quantize, group_size);
        options.max_sequence = integer_argument("max_seq", max_seq);
        options.max_sequence_source = "max_seq";  // messages name the keyword, not the CLI's option
        options.max_sequence_option = "max_seq=";
        // Every argument is checked before a GPU is looked for: quantize=3 read "no CUDA device" without one.
        DecoderModel::check_load_arguments(path.value, options);
#ifdef METILE_HAVE_CUDA_BACKEND
        std::optional<CudaDevice> device;
        if (backend == "cuda") {
          // Before the checkpoint is read: no GPU is one clear error at once.
          std::string reason;
          device = CudaDevice::try_open(0, &reason);
          if (!device) throw InputError("backend='cuda': " + reason + " (backend='cpu' runs everywhere)");
        }
#else
        if (backend == "cuda") {
          throw InputError("backend='cuda': this metile was built without the CUDA toolkit; use backend='cpu'");
        }
#endif
        // The checkpoint's warnings (layers past num_hidden_layers, unused weights, an unreadable
        // generation_config.json) are UserWarnings, as quantize='s notes: printed on stderr they could be
        // neither caught nor filtered nor made errors.
        std::vector<std::string> load_warnings;
        std::mutex load_warnings_mutex;
        options.warn = [&](const std::string& line) {
          const std::lock_guard lock(load_warnings_mutex);
          load_warnings.push_back(line);
        };
        std::shared_ptr<DecoderModel> model;
        std::exception_ptr failure;  // warned of first, as the CLI prints its warnings before the error
        {
          py::gil_scoped_release release;  // reading a checkpoint takes seconds: other threads run meanwhile
          try {
            model = std::make_shared<DecoderModel>(DecoderModel::load(path.value, options));
          } catch (...) {
            failure = std::current_exception();
          }
        }
        for (const std::string& line : load_warnings) warn_user(line);
        if (failure) std::rethrow_exception(failure);
        if (options.quantize) warn_of_matrices_left_dense(model->config(), *options.quantize);
#ifdef METILE_HAVE_CUDA_BACKEND
        if (device) {
          auto held = std::make_shared<PythonCudaModel>();
          held->model = model;
          {
            py::gil_scoped_release release;
            // Uploads and plan builds take seconds to minutes on large models: say so on stderr.
            const EngineProgress progress = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
            held->session = std::make_unique<CudaDecodeSession>(CudaModel::load(*model, *device, progress),
                                                                EngineOptions{EnginePath::fused, {}, progress});
          }
          return py::cast(held);
        }
#endif
        return py::cast(model);
      },
      py::arg("path"), py::arg("dtype") = "bf16", py::arg("quantize") = py::none(), py::arg("group_size") = py::none(),
      py::arg("max_seq") = 0, py::arg("backend") = "cpu",
      "Loads a Llama/Qwen2/Mistral checkpoint (Hugging Face or MLX layout); backend='cuda' puts it on the GPU");

  module.def(
      "synth_model",
      [](const FilePath& path, const Utf8Text& preset, const std::optional<Utf8Text>& arch,
         const py::handle& layers, const py::handle& seed, const py::handle& quantize, const py::handle& group_size,
         const py::handle& tie_word_embeddings, const py::handle& config_spelling, const py::handle& max_shard_mb) {
        SynthOptions options;
        options.preset = preset.value;
        if (arch) options.architecture = parse_architecture_short_name(arch->value);
        if (!layers.is_none()) options.layers = integer_argument("layers", layers);
        options.seed = unsigned_argument("seed", seed);  // True is not seed 1
        options.quantize = quantization_of(quantize, group_size);
        if (!tie_word_embeddings.is_none()) {  // 1 or "no" is not a yes or no
          options.tie_word_embeddings =
              boolean_argument("tie_word_embeddings", tie_word_embeddings, "True, False or None");
        }
        options.transformers_version = integer_argument("config_spelling", config_spelling);  // True is not 1
        options.max_shard_mb = real_argument("max_shard_mb", max_shard_mb);
        if (options.quantize) warn_of_matrices_left_dense(synth_config(options), *options.quantize);
        // Written without the GIL; Ctrl-C is looked for between tensors, as the command line's synth-model
        // does, and cancels the write (nothing is left) with Python's KeyboardInterrupt. Holding the GIL,
        // the interrupt was seen only once the whole checkpoint had been written.
        std::optional<py::error_already_set> interruption;
        try {
          py::gil_scoped_release release;
          synthesize_model(path.value, options, {}, [&] {
            py::gil_scoped_acquire acquire;
            if (PyErr_CheckSignals() == 0) return false;
            interruption.emplace();  // the handler's exception (KeyboardInterrupt), taken from Python's error state
            return true;
          });
        } catch (const InputError&) {
          if (interruption) throw *interruption;
          throw;
        }
      },
      py::arg("path"), py::arg("preset") = "tiny", py::arg("arch") = py::none(), py::arg("layers") = py::none(),
      py::arg("seed") = 0, py::arg("quantize") = py::none(), py::arg("group_size") = py::none(),
      py::arg("tie_word_embeddings") = py::none(), py::arg("config_spelling") = 4, py::arg("max_shard_mb") = 2000,
      "Writes a seeded random checkpoint in the Hugging Face layout (shards of at most max_shard_mb MB)");
}

}  // namespace metile::python

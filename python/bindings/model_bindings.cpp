// Python bindings of the model module (include/metile/model.h):
//   metile.load_model(path, dtype="bf16", quantize=None, group_size=64, max_seq=0) -> Model
//     Model.logits(ids) -> float32 numpy [len(ids), vocab], a fresh sequence each call
//     Model.generate(ids, n) -> int32 numpy [n], greedy
//   metile.synth_model(path, preset="tiny", arch=None, layers=None, seed=0, quantize=None,
//                      group_size=64, tie_word_embeddings=None, config_spelling=4)
// Bad checkpoints and arguments raise ValueError with the C++ message.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <memory>

#include "bindings.h"
#include "metile/model.h"

namespace metile::python {
namespace {

std::optional<AffineQuantization> quantization_of(std::optional<int> bits, int group_size) {
  if (!bits) return std::nullopt;
  AffineQuantization format{*bits, group_size};
  format.validate();
  return format;
}

std::vector<std::int32_t> token_ids(const py::handle& ids) {
  if (py::isinstance<py::str>(ids)) throw py::type_error("ids must be a sequence of integers, got str");
  std::vector<std::int32_t> tokens;
  for (const py::handle& item : py::iter(ids)) {
    if (!py::isinstance<py::int_>(item) && !py::isinstance(item, py::module_::import("numpy").attr("integer"))) {
      throw py::type_error("ids must hold integers, got " + std::string(py::str(py::type::handle_of(item).attr("__name__"))));
    }
    tokens.push_back(item.cast<std::int32_t>());
  }
  if (tokens.empty()) throw InputError("ids is empty");
  return tokens;
}

}  // namespace

void bind_model(py::module_& module) {
  py::class_<DecoderModel, std::shared_ptr<DecoderModel>>(module, "Model",
                                                          "A decoder checkpoint loaded for CPU decoding")
      .def_property_readonly("vocab_size", [](const DecoderModel& model) { return model.config().vocab_size; })
      .def_property_readonly("num_layers", [](const DecoderModel& model) { return model.config().num_hidden_layers; })
      .def_property_readonly("dtype", [](const DecoderModel& model) { return std::string(dtype_name(model.dtype())); })
      .def_property_readonly("capacity", &DecoderModel::capacity)
      .def(
          "logits",
          [](const DecoderModel& model, const py::handle& ids) {
            const std::vector<std::int32_t> tokens = token_ids(ids);
            std::vector<float> logits;
            {
              py::gil_scoped_release release;
              DecodeSession session(model);
              logits = session.feed(tokens);
            }
            py::array_t<float> array({static_cast<py::ssize_t>(tokens.size()),
                                      static_cast<py::ssize_t>(model.config().vocab_size)});
            std::copy(logits.begin(), logits.end(), array.mutable_data());
            return array;
          },
          py::arg("ids"), "Logits [len(ids), vocab] of a fresh sequence (float32)")
      .def(
          "generate",
          [](const DecoderModel& model, const py::handle& ids, std::int64_t count) {
            const std::vector<std::int32_t> tokens = token_ids(ids);
            Generation generation;
            {
              py::gil_scoped_release release;
              DecodeSession session(model);
              generation = generate_greedy(session, tokens, count);
            }
            py::array_t<std::int32_t> array(static_cast<py::ssize_t>(generation.tokens.size()));
            std::copy(generation.tokens.begin(), generation.tokens.end(), array.mutable_data());
            return array;
          },
          py::arg("ids"), py::arg("n"), "n greedy tokens after ids (int32)");

  module.def(
      "load_model",
      [](const std::filesystem::path& path, const std::string& dtype, std::optional<int> quantize, int group_size,
         std::int64_t max_seq) {
        LoadOptions options;
        options.dtype = parse_dtype(dtype);
        options.quantize = quantization_of(quantize, group_size);
        options.max_sequence = max_seq;
        return std::make_shared<DecoderModel>(DecoderModel::load(path, options));
      },
      py::arg("path"), py::arg("dtype") = "bf16", py::arg("quantize") = py::none(), py::arg("group_size") = 64,
      py::arg("max_seq") = 0, "Loads a Llama/Qwen2/Mistral checkpoint (Hugging Face or MLX layout)");

  module.def(
      "synth_model",
      [](const std::filesystem::path& path, const std::string& preset, std::optional<std::string> arch,
         std::optional<std::int64_t> layers, std::uint64_t seed, std::optional<int> quantize, int group_size,
         std::optional<bool> tie_word_embeddings, int config_spelling) {
        SynthOptions options;
        options.preset = preset;
        if (arch) options.architecture = parse_architecture_short_name(*arch);
        options.layers = layers;
        options.seed = seed;
        options.quantize = quantization_of(quantize, group_size);
        options.tie_word_embeddings = tie_word_embeddings;
        options.transformers_version = config_spelling;
        synthesize_model(path, options);
      },
      py::arg("path"), py::arg("preset") = "tiny", py::arg("arch") = py::none(), py::arg("layers") = py::none(),
      py::arg("seed") = 0, py::arg("quantize") = py::none(), py::arg("group_size") = 64,
      py::arg("tie_word_embeddings") = py::none(), py::arg("config_spelling") = 4,
      "Writes a seeded random checkpoint in the Hugging Face layout");
}

}  // namespace metile::python

// A bounded walk over a GGUF file's header, before ggml's parser sees it. ggml's gguf reader
// asserts (aborting the process) on several malformed headers (a tensor rank above 4, a dimension
// <= 0 or overflowing, an unknown value type) and allocates whatever sizes the file claims; drafts
// come from anyone's repository, so every count, length, type and offset is checked here against
// the file's own size first, and a bad file is refused with what is wrong and where.

#include "dflash.h"
#include "dflash-impl.h"

#include "ggml.h"

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

using dflash_impl::fail;

namespace {

// GGUF value types (the file format's numbering)
enum : uint32_t {
    T_U8, T_I8, T_U16, T_I16, T_U32, T_I32, T_F32, T_BOOL, T_STRING, T_ARRAY, T_U64, T_I64, T_F64, T_COUNT
};
constexpr uint64_t k_scalar_size[T_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
constexpr uint64_t k_max_string = 1u << 20;  // keys, names and values: GGUF strings are short
constexpr int k_max_dims = 4;                // GGML_MAX_DIMS

struct file_closer {
    void operator()(FILE * f) const { fclose(f); }
};

class header_reader {
public:
    header_reader(const char * path) : file_(fopen(path, "rb")) {
        if (!file_) {
            fail("cannot open '%s'", path);
        }
        fseek(file_.get(), 0, SEEK_END);
        size_ = (uint64_t) ftell(file_.get());
        fseek(file_.get(), 0, SEEK_SET);
    }

    uint64_t size() const { return size_; }
    uint64_t offset() const { return offset_; }

    void bytes(void * out, uint64_t n, const char * what) {
        ensure_left(n, what);
        if (fread(out, 1, n, file_.get()) != n) {
            fail("cannot read %s at offset %" PRIu64, what, offset_);
        }
        offset_ += n;
    }

    template <typename T> T value(const char * what) {
        T v;
        bytes(&v, sizeof(v), what);
        return v;
    }

    void skip(uint64_t n, const char * what) {
        ensure_left(n, what);
        fseek(file_.get(), (long) n, SEEK_CUR);
        offset_ += n;
    }

    std::string string(const char * what) {
        const uint64_t n = value<uint64_t>(what);
        if (n > k_max_string) {
            fail("%s at offset %" PRIu64 " claims %" PRIu64 " bytes: corrupt", what, offset_ - 8, n);
        }
        std::string s(n, '\0');
        bytes(s.data(), n, what);
        return s;
    }

private:
    void ensure_left(uint64_t n, const char * what) const {
        if (n > size_ - offset_) {
            fail("the file ends inside %s (offset %" PRIu64 " of %" PRIu64 " bytes): truncated or corrupt", what,
                 offset_, size_);
        }
    }

    std::unique_ptr<FILE, file_closer> file_;
    uint64_t size_ = 0;
    uint64_t offset_ = 0;
};

// Past a KV's value, checking its type and every length in it.
void skip_value(header_reader & r, const std::string & key, uint32_t type) {
    if (type >= T_COUNT) {
        fail("key '%s' has unknown value type %u", key.c_str(), type);
    }
    if (type == T_STRING) {
        r.string(("the value of '" + key + "'").c_str());
        return;
    }
    if (type != T_ARRAY) {
        r.skip(k_scalar_size[type], key.c_str());
        return;
    }
    const uint32_t item = r.value<uint32_t>(key.c_str());
    const uint64_t n = r.value<uint64_t>(key.c_str());
    if (item >= T_COUNT || item == T_ARRAY) {
        fail("key '%s' is an array of unknown or nested type %u", key.c_str(), item);
    }
    if (item == T_STRING) {
        // each string takes at least its 8-byte length
        if (n > (r.size() - r.offset()) / 8) {
            fail("key '%s' claims %" PRIu64 " strings, more than the file holds", key.c_str(), n);
        }
        for (uint64_t i = 0; i < n; ++i) {
            r.string(("an item of '" + key + "'").c_str());
        }
        return;
    }
    if (n > (r.size() - r.offset()) / k_scalar_size[item]) {
        fail("key '%s' claims %" PRIu64 " items, more than the file holds", key.c_str(), n);
    }
    r.skip(n * k_scalar_size[item], key.c_str());
}

struct tensor_extent {
    std::string name;
    uint64_t offset, nbytes;
};

tensor_extent read_tensor_info(header_reader & r, uint64_t index) {
    tensor_extent t;
    t.name = r.string("a tensor name");
    if (t.name.size() >= GGML_MAX_NAME) {
        fail("tensor %" PRIu64 " has a name of %zu bytes (at most %d)", index, t.name.size(), GGML_MAX_NAME - 1);
    }
    const uint32_t n_dims = r.value<uint32_t>("a tensor rank");
    if (n_dims < 1 || n_dims > k_max_dims) {
        fail("tensor '%s' has rank %u (1 to %d)", t.name.c_str(), n_dims, k_max_dims);
    }
    int64_t ne[k_max_dims] = {1, 1, 1, 1};
    int64_t n_elements = 1;
    for (uint32_t i = 0; i < n_dims; ++i) {
        ne[i] = r.value<int64_t>("a tensor dimension");
        if (ne[i] <= 0 || ne[i] > INT64_MAX / n_elements) {
            fail("tensor '%s' has dimension %u = %" PRId64 ": not positive, or too many elements", t.name.c_str(), i,
                 ne[i]);
        }
        n_elements *= ne[i];
    }
    const uint32_t type = r.value<uint32_t>("a tensor type");
    if (type >= GGML_TYPE_COUNT || ggml_blck_size((ggml_type) type) <= 0 || ggml_type_size((ggml_type) type) == 0) {
        fail("tensor '%s' has unknown type %u", t.name.c_str(), type);
    }
    const int64_t block = ggml_blck_size((ggml_type) type);
    if (ne[0] % block != 0) {
        fail("tensor '%s': a row of %" PRId64 " is not a whole number of %s blocks of %" PRId64, t.name.c_str(), ne[0],
             ggml_type_name((ggml_type) type), block);
    }
    const uint64_t row_bytes = (uint64_t) (ne[0] / block) * ggml_type_size((ggml_type) type);
    const uint64_t rows = (uint64_t) (n_elements / ne[0]);
    if (rows > 0 && row_bytes > UINT64_MAX / rows) {
        fail("tensor '%s' is too large", t.name.c_str());
    }
    t.nbytes = row_bytes * rows;
    t.offset = r.value<uint64_t>("a tensor offset");
    return t;
}

}  // namespace

namespace dflash_impl {

void check_gguf_layout(const char * path) {
    header_reader r(path);
    char magic[4];
    r.bytes(magic, 4, "the magic");
    if (memcmp(magic, "GGUF", 4) != 0) {
        fail("not a GGUF file (the file does not start with 'GGUF')");
    }
    const uint32_t version = r.value<uint32_t>("the version");
    if (version < 2 || version > 3) {
        fail("GGUF version %u is not supported (2 or 3)", version);
    }
    const uint64_t n_tensors = r.value<uint64_t>("the tensor count");
    const uint64_t n_kv = r.value<uint64_t>("the key count");
    // a key takes at least 12 bytes (length, type) and a tensor info at least 24
    if (n_kv > r.size() / 12 || n_tensors > r.size() / 24) {
        fail("the header claims %" PRIu64 " keys and %" PRIu64 " tensors, more than the file holds: truncated or corrupt",
             n_kv, n_tensors);
    }
    uint64_t alignment = 32;  // GGUF's default
    for (uint64_t i = 0; i < n_kv; ++i) {
        const std::string key = r.string("a key");
        const uint32_t type = r.value<uint32_t>(("the type of '" + key + "'").c_str());
        if (key != "general.alignment") {
            skip_value(r, key, type);
            continue;
        }
        if (type != T_U32) {
            fail("key 'general.alignment' must be a u32");
        }
        alignment = r.value<uint32_t>("general.alignment");
        if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
            fail("general.alignment %" PRIu64 " is not a power of two", alignment);
        }
    }
    std::vector<tensor_extent> tensors;
    for (uint64_t i = 0; i < n_tensors; ++i) {
        tensors.push_back(read_tensor_info(r, i));
    }
    const uint64_t data_start = (r.offset() + alignment - 1) / alignment * alignment;
    if (data_start > r.size()) {
        fail("the file ends before its tensor data: truncated");
    }
    const uint64_t data_size = r.size() - data_start;
    for (const auto & t : tensors) {
        if (t.offset % alignment != 0) {
            fail("tensor '%s' has offset %" PRIu64 ", not a multiple of the alignment %" PRIu64, t.name.c_str(),
                 t.offset, alignment);
        }
        if (t.offset > data_size || t.nbytes > data_size - t.offset) {
            fail("tensor '%s' (%" PRIu64 " bytes at %" PRIu64 ") lies past the end of the file's %" PRIu64
                 " data bytes: truncated or corrupt", t.name.c_str(), t.nbytes, t.offset, data_size);
        }
    }
}

}  // namespace dflash_impl

int dflash_gguf_check(const char * path) {
    return dflash_impl::guarded([&]() -> int {
        dflash_impl::check_gguf_layout(path);
        return 0;
    }, -1);
}

// Fuzz target for the TCP store's wire decoder (src/comm/store/store_wire.h): the
// bytes a TcpStoreServer reads from an authenticated client, and those a client reads back.
//
// Checked on every input, beyond "no crash, no sanitizer report":
//  - frames are decoded back to back as the server does with a connection's buffer; an
//    accepted frame re-encodes to exactly its bytes (the encoding is canonical) and an error
//    always carries a message;
//  - the same bytes as a reply body to each opcode: an accepted reply re-encodes to them.
// Built two ways (fuzz/CMakeLists.txt): as a libFuzzer binary (clang, -DDTRAIN_FUZZ=ON) and
// as store_frame_fuzz_replay (any compiler, replay_main.cpp), which CTest runs.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "../src/comm/store/store_wire.h"

namespace wire = dtrain::comm::net::store_wire;

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  size_t pos = 0;
  while (pos < size) {
    const wire::RequestDecode d = wire::decode_request_frame(data + pos, size - pos);
    if (d.status == wire::Decode::incomplete) break;
    if (d.status == wire::Decode::error) {
      check(!d.error.empty());
      break;
    }
    check(d.consumed >= 5 && d.consumed <= size - pos);
    const std::string again = wire::encode_request_frame(d.request);
    check(again.size() == d.consumed && std::memcmp(again.data(), data + pos, d.consumed) == 0);
    pos += d.consumed;
  }

  for (uint8_t op = 1; op <= 6; ++op) {
    const wire::ReplyDecode r = wire::decode_reply_body(static_cast<wire::Op>(op), data, size);
    if (!r.ok) {
      check(!r.error.empty());
      continue;
    }
    const std::string frame = wire::encode_reply_frame(static_cast<wire::Op>(op), r.reply);
    check(frame.size() == size + 4 && std::memcmp(frame.data() + 4, data, size) == 0);
  }
  return 0;
}

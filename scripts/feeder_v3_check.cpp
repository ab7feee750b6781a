// Drive Chakra's feeder_v3 (the ETFeeder of newer ASTRA-sim) over .et files, as ASTRA-sim's
// Workload does: issue every dependency-free node, finish it, repeat. Checks that the feeder
// loads each file (graph_sanity_check: every data/ctrl dependency names a node of the file;
// at least one node without dependencies) and issues every node (no cycle cuts a run short),
// METADATA nodes included.
//
// Not built by the package: it needs feeder_v3's sources (mlcommons/chakra or
// astra-sim/chakra, src/feeder_v3/) and protobuf. See docs/export.md, "The newer feeder".
//
//   protoc --cpp_out=BUILD -I prism_trace/formats prism_trace/formats/chakra/et_def.proto
//   g++ -std=c++17 -O1 -I BUILD -I FEEDER_V3 scripts/feeder_v3_check.cpp FEEDER_V3/*.cpp \
//       BUILD/et_def.pb.cc -lprotobuf -o feeder_v3_check
//   ./feeder_v3_check DIR/PREFIX.*.et
//
// Prints one line per file (nodes in the file, nodes issued, METADATA nodes issued) and exits 1
// when a file fails to load or leaves nodes unissued.

#include <cstdint>
#include <fstream>
#include <iostream>
#include <string>
#include <unordered_set>

#include "et_feeder.h"
#include "protobuf_util.h"

using Chakra::FeederV3::ChakraGlobalMetadata;
using Chakra::FeederV3::ChakraNode;
using Chakra::FeederV3::NodeId;
using Chakra::FeederV3::ProtobufUtils;

namespace {

// Node ids in the file, read independently of the feeder.
std::unordered_set<NodeId> file_nodes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  ChakraGlobalMetadata meta;
  ProtobufUtils::readMessage(f, meta);
  std::unordered_set<NodeId> ids;
  ChakraNode node;
  while (ProtobufUtils::readMessage(f, node)) ids.insert(node.id());
  return ids;
}

bool check(const std::string& path) {
  const auto ids = file_nodes(path);
  std::unordered_set<NodeId> issued;
  uint64_t metadata = 0;
  try {
    Chakra::ETFeeder feeder(path);
    while (feeder.hasNodesToIssue()) {
      auto node = feeder.getNextIssuableNode();
      const NodeId id = node->id();
      if (!issued.insert(id).second) {
        std::cout << path << ": node " << id << " issued twice\n";
        return false;
      }
      if (node->type() == ChakraProtoMsg::METADATA_NODE) ++metadata;
      feeder.freeChildrenNodes(id);
    }
  } catch (const std::exception& e) {
    std::cout << path << ": feeder_v3 refused the file: " << e.what() << "\n";
    return false;
  }
  const bool ok = issued.size() == ids.size();
  std::cout << path << ": nodes " << ids.size() << ", issued " << issued.size()
            << ", metadata " << metadata << (ok ? ", ok" : ", NODES LEFT UNISSUED") << "\n";
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: feeder_v3_check FILE.et...\n";
    return 2;
  }
  bool ok = true;
  for (int i = 1; i < argc; ++i) ok = check(argv[i]) && ok;
  return ok ? 0 : 1;
}
